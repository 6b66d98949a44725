"""GPT/Llama models built from tpflash.layers, and Hugging Face import/export."""
