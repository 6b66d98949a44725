source scripts/gpu_env.sh
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
for mode in eager graphs; do
  extra=""; [ $mode = graphs ] && extra="--cuda_graphs=on"
  STEPS=24 LOG=4 bash scripts/gpu_trainer.sh . $mode --log.trace=21:22 $extra
  T=$OUT/run_$mode/trace/rank0.json; ls -la $T
  python3 - $T <<'PY'
import json, sys, collections
ev = json.load(open(sys.argv[1]))["traceEvents"]
cats = collections.Counter(e.get("cat") for e in ev)
marks = sorted({e["name"] for e in ev if str(e.get("name", "")).startswith("train_step")})
k = [e for e in ev if e.get("cat") == "kernel"]
print("marks", marks, "kernels", len(k), "kernel ms", round(sum(e["dur"] for e in k) / 1e3, 1), "cats", dict(cats.most_common(8)))
PY
  python3 scripts/trace_lag.py $T --steps 2 2>&1 | head -12
  mkdir -p /tmp/tr && mv $OUT/run_$mode/trace /tmp/tr/$mode
done
python3 -m pytest tests/train tests/distributed/test_state.py tests/distributed/test_stop_signal.py -m "gpu or not gpu" -n 4 -q 2>&1 | tail -4
