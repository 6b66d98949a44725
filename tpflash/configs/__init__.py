"""The trainer's packaged YAML configs, found by name: `--config demo` reads demo.yaml here.

Installed with the package (setup.py's package_data), so the names resolve from any directory.
"""
from pathlib import Path
from typing import List, Optional

DIR = Path(__file__).resolve().parent


def names() -> List[str]:
    """The packaged config names (file names without .yaml), sorted."""
    return sorted(p.stem for p in DIR.glob("*.yaml"))


def find(name: str) -> Optional[Path]:
    """The packaged file for `name` ("demo" or "demo.yaml"), or None when there is none."""
    stem = name[:-len(".yaml")] if name.endswith(".yaml") else name
    if not stem or "/" in stem or "\\" in stem or stem not in names():
        return None
    return DIR / f"{stem}.yaml"
