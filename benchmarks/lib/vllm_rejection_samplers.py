"""vLLM's Triton rejection samplers, loaded from an unpacked vllm source tree for comparison.

Only the sampler files (and the kernel helpers they import) are executed; every other ``vllm.*``
import is replaced by a stub, so no vllm install, config or CUDA extension is needed. Two samplers:

- ``v1``: ``vllm/v1/sample/rejection_sampler.py`` (the V1 model runner): torch softmax over the
  draft rows, a greedy kernel, a recovered-token kernel over full vocab rows with torch-generated
  exponential noise, a random kernel; bonus tokens come from vLLM's separate Sampler, stood in for
  here by a torch softmax + exponential race over the bonus rows.
- ``v2``: ``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py`` (the V2 model runner):
  per-vocab-block statistics, a rejection kernel, a resample kernel, in-kernel Philox noise. Its
  ``apply_sampling_params`` step (penalties, temperature) is not included.

A step builder returns a zero-argument callable that runs one verification step on the benchmark's
inputs, or raises if the file's API is not the one this adapter knows.
"""

import builtins
import inspect
import logging
import types
from pathlib import Path

import torch
import triton
from triton.language.extra import libdevice

from specsplit.kernels import SparseDraftProbs

V1_FILE = "vllm.v1.sample.rejection_sampler"
V2_FILE = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
REAL_MODULES = {"vllm.v1.worker.gpu.sample.gumbel"}  # kernel helpers the V2 sampler imports


class _Stub:
    """Stands in for any vllm object a sampler file imports but its kernels do not need."""

    def __init__(self, name: str = "stub"):
        self._name = name

    def __getattr__(self, name: str):
        return _Stub(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator
        return _Stub(self._name + "()")

    def __getitem__(self, item):
        return _Stub(self._name + "[]")

    def __mro_entries__(self, bases):
        return (object,)


def _stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__getattr__ = lambda attr: _Stub(f"{name}.{attr}")
    module.triton, module.tl, module.tldevice, module.HAS_TRITON = triton, triton.language, libdevice, True
    module.init_logger = logging.getLogger
    module.apply_top_k_top_p = lambda logits, k, p, *rest, **kw: logits
    return module


def exec_vllm_file(src: Path, module: str) -> dict:
    """Executes ``src/<module path>.py`` with vllm imports stubbed; returns its namespace."""
    path = src / (module.replace(".", "/") + ".py")

    def vllm_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name in REAL_MODULES:
            return types.SimpleNamespace(**exec_vllm_file(src, name))
        if name == "vllm" or name.startswith("vllm."):
            return _stub_module(name)
        return builtins.__import__(name, globals, locals, fromlist, level)

    namespace = {
        "__name__": module,
        "__file__": str(path),
        "__builtins__": {**vars(builtins), "__import__": vllm_import},
    }
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # a real path: triton reads the source
    return namespace


def load(src: Path) -> dict[str, object]:
    """{"v1": step builder or error message, "v2": ...}."""
    samplers: dict[str, object] = {}
    for name, module, builder in (("v1", V1_FILE, _v1_builder), ("v2", V2_FILE, _v2_builder)):
        try:
            samplers[name] = builder(exec_vllm_file(src, module))
        except Exception as err:  # a missing file or an API this adapter does not know: report it
            samplers[name] = f"{module}: {err!r}"[:300]
    return samplers


def _dense_q(inputs: dict, batch: int, k: int) -> torch.Tensor | None:
    q = inputs.get("draft_probs")
    if isinstance(q, SparseDraftProbs):  # vLLM takes dense draft distributions only
        vocab_size = inputs["target_logits"].shape[1]
        q = torch.zeros(batch * k, vocab_size, device=q.ids.device).scatter_(1, q.ids, q.probs)
    return q


def _v1_builder(namespace: dict):
    sample = namespace["rejection_sample"]
    constraints = namespace.get("apply_sampling_constraints") or namespace["compute_probs"]
    takes_probs = "target_probs" in inspect.signature(sample).parameters  # older: softmax before the call
    greedy_temperature = float(getattr(namespace.get("GREEDY_TEMPERATURE"), "value", 0))

    def build(inputs: dict, batch: int, k: int, mode: str):
        logits = inputs["target_logits"]
        greedy = mode == "greedy"
        rows = torch.arange(batch * (k + 1), device=logits.device).view(batch, k + 1)
        target_rows, bonus_rows = rows[:, :k].reshape(-1), rows[:, k]
        temperature = inputs["temperature"].clone()
        if greedy:
            temperature.fill_(greedy_temperature)
        metadata = types.SimpleNamespace(
            all_greedy=greedy, all_random=not greedy, temperature=temperature, top_k=None, top_p=None,
            generators={}, max_num_logprobs=None,
        )  # fmt: skip
        cu_num_draft_tokens = inputs["cu_num_draft"][1:].contiguous()
        draft_ids, q = inputs["draft_token_ids"].contiguous(), _dense_q(inputs, batch, k)

        def step():
            bonus_logits = logits[bonus_rows]
            if greedy:
                bonus = bonus_logits.argmax(-1, keepdim=True).int()
            else:
                probs = (bonus_logits / temperature[:, None]).softmax(-1)
                bonus = (probs / torch.empty_like(probs).exponential_()).argmax(-1, keepdim=True).int()
            target = constraints(logits[target_rows].float(), cu_num_draft_tokens, metadata)
            if takes_probs and not greedy:
                target = target.softmax(dim=-1, dtype=torch.float32)
            return sample(draft_ids, [k] * batch, k, cu_num_draft_tokens, q, target, bonus, metadata)

        return step

    return build


def _v2_builder(namespace: dict):
    sample = namespace["rejection_sample"]
    params = list(inspect.signature(sample).parameters)
    expected = ["target_logits", "draft_logits", "draft_sampled", "cu_num_logits", "pos", "idx_mapping"]
    if params[: len(expected)] != expected:
        raise ValueError(f"unknown V2 rejection_sample signature {params}")

    def build(inputs: dict, batch: int, k: int, mode: str):
        logits = inputs["target_logits"]
        device = logits.device
        draft_sampled = torch.zeros(batch, k + 1, dtype=torch.int64, device=device)
        draft_sampled[:, 1:] = inputs["draft_token_ids"].view(batch, k)  # row i's draft is input i + 1
        local_pos = torch.arange(k + 1, device=device).repeat(batch)
        args = dict(
            target_logits=logits,
            draft_logits=None,
            draft_sampled=draft_sampled.view(-1),
            cu_num_logits=torch.arange(batch + 1, dtype=torch.int32, device=device) * (k + 1),
            pos=inputs["positions"].repeat_interleave(k + 1) + local_pos,
            idx_mapping=torch.arange(batch, dtype=torch.int32, device=device),
            expanded_idx_mapping=torch.arange(batch, dtype=torch.int32, device=device).repeat_interleave(k + 1),
            expanded_local_pos=local_pos.to(torch.int32),
            temperature=inputs["temperature"],
            seed=inputs["seeds"],
            num_speculative_steps=k,
        )
        q = _dense_q(inputs, batch, k)
        if q is not None:
            args["draft_logits"] = q.log().view(batch, k, -1)  # V2 takes draft logits
        return lambda: sample(**args)

    return build
