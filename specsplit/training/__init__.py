"""Training of the demo checkpoint: a small Llama target plus one DeepSeek-V3 style MTP module.

`python -m specsplit.training.train_demo` (wired as `specsplit train-demo`) builds a byte-level BPE tokenizer
and a token corpus from this machine's Python standard library, trains target and MTP module jointly
and writes a Hugging Face checkpoint directory. Not imported by the services.
"""
