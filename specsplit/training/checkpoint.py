"""Writing and reading the demo checkpoint directory.

Layout (a plain Hugging Face Llama directory that also carries the MTP module):
  config.json            LlamaConfig + "num_nextn_predict_layers": 1
  generation_config.json greedy, bos = eos = <|endoftext|>
  model.safetensors      the target's tensors (lm_head tied to model.embed_tokens) and the MTP module
                         under model.layers.{num_hidden_layers}.*, shared_head.head stored as a copy
  tokenizer.json, tokenizer_config.json
  heldout_files.txt      the held-out stdlib files the reported numbers were measured on
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, GenerationConfig

from specsplit.training.joint_model import TargetWithMTP

WEIGHTS_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def mtp_prefix(config) -> str:
    return f"model.layers.{config.num_hidden_layers}."


def checkpoint_state_dict(model: TargetWithMTP, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under its file name, as independent contiguous `dtype` copies."""
    state = {k: v for k, v in model.target.state_dict().items() if k != "lm_head.weight"}
    prefix = mtp_prefix(model.config)
    state.update({prefix + k: v for k, v in model.mtp.state_dict().items()})
    return {k: v.detach().to(device="cpu", dtype=dtype).clone().contiguous() for k, v in state.items()}


def save_checkpoint(
    model: TargetWithMTP, out_dir: Path, tokenizer_dir: Path, heldout_files: list[str], dtype=torch.bfloat16
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype
    config.save_pretrained(str(out_dir))
    config_path = out_dir / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["torch_dtype"] = config_json["dtype"]  # the name older loaders read
    config_path.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    ).save_pretrained(str(out_dir))
    save_file(checkpoint_state_dict(model, dtype), str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    (out_dir / "heldout_files.txt").write_text("".join(f"{rel}\n" for rel in heldout_files))


def load_checkpoint(ckpt_dir: Path, device: str = "cpu") -> TargetWithMTP:
    """The checkpoint as a float32 TargetWithMTP (the training module), for measurement."""
    config = AutoConfig.from_pretrained(str(ckpt_dir))
    config._attn_implementation = "sdpa"
    model = TargetWithMTP(config)
    state = {k: v.float() for k, v in load_file(str(ckpt_dir / WEIGHTS_NAME)).items()}
    prefix = mtp_prefix(config)
    mtp_state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    target_state = {k: v for k, v in state.items() if not k.startswith(prefix)}
    missing, unexpected = model.target.load_state_dict(target_state, strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise ValueError(f"checkpoint does not match the config: missing {missing}, unexpected {unexpected}")
    head = mtp_state.pop("shared_head.head.weight")
    if not torch.equal(head, model.target.get_input_embeddings().weight.detach()):
        raise ValueError("shared_head.head differs from the embedding; this loader ties them")
    missing, unexpected = model.mtp.load_state_dict(mtp_state, strict=False)
    if set(missing) - {"shared_head.head.weight"} or unexpected:
        raise ValueError(f"MTP tensors do not match: missing {missing}, unexpected {unexpected}")
    return model.to(device).eval()
