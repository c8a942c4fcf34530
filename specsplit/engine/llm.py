"""`specsplit.LLM`: offline generation in one process, with the checkpoint's MTP drafts.

    from specsplit import LLM
    llm = LLM("checkpoints/demo", num_speculative_tokens=3)
    (result,) = llm.generate(["def read_lines(path):\\n"], max_tokens=64)
    print(result.text, result.stats.acceptance_rate)

The iteration is the services' own: the coordinator's loop (`specsplit/coordinator/engine.py`) over the verifier's
step (`specsplit/verifier/step.py`) over the drafter's runner, joined in this process by `specsplit/engine/local.py`
instead of gRPC; outputs are the same (greedy: equal to target-only decoding).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from specsplit.client.results import GenerationResult
from specsplit.client.sdk import structured_output_pb
from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.engine import Engine, RequestOutput
from specsplit.coordinator.iteration import IterationTiming
from specsplit.coordinator.request import Request
from specsplit.coordinator.scheduler import Scheduler
from specsplit.coordinator.validation import build_request
from specsplit.drafter.draft_vocab import draft_vocabulary
from specsplit.drafter.runner import DrafterRunner
from specsplit.drafter.server import DEFAULT_DRAFT_VOCAB_SIZE
from specsplit.engine.local import LocalDrafter, LocalVerifier
from specsplit.models.loader import load_mtp, load_target
from specsplit.proto import coordinator_pb2
from specsplit.verifier.runner import VerifierRunner
from specsplit.verifier.step import VerifierStep
from specsplit.verifier.worker import VerifierWorker


class LLM:
    """A target and its MTP module on one device. `num_speculative_tokens` 0: target-only decoding; else the drafts
    every request gets per iteration (as `serve`'s default), or with `adaptive=True` the most it gets, chosen per
    request and iteration (learning across generate() calls). `load_format="dummy"`: seeded random weights from
    config.json (benchmarks). `enable_prefix_caching`: prompts start on the cached KV of the blocks they share with
    earlier requests (as `serve`'s default). `draft_vocab_size`: the ids the drafts are picked from (`serve drafter
    --draft-vocab-size`; 0: every id)."""

    def __init__(
        self,
        model: str | Path,
        *,
        num_speculative_tokens: int = 3,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        load_format: str = "auto",
        num_blocks: int = 1024,
        block_size: int = 16,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        device_hand_off: bool = True,
        adaptive: bool = False,
        enable_prefix_caching: bool = True,
        draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
    ):
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model = str(model)
        self.target = load_target(self.model, dtype=dtype, device=device, load_format=load_format)
        config = self.target.config
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = min(config.max_position_embeddings, num_blocks * block_size)
        self.eos_token_ids = list(config.eos_token_ids)
        self.scheduler_config = SchedulerConfig(
            max_model_len=self.max_model_len,
            block_size=block_size,
            num_blocks=num_blocks,
            num_speculative_tokens=num_speculative_tokens,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(max_num_batched_tokens, num_speculative_tokens + 1),
            max_waiting=1 << 30,  # offline: every prompt of a generate() call waits its turn
            adaptive=adaptive,
            enable_prefix_caching=enable_prefix_caching,
        )
        runner = VerifierRunner(
            self.target, self.target.make_kv_cache(num_blocks, block_size), max_model_len=self.max_model_len
        )
        worker = VerifierWorker(
            runner,
            vocab_size=config.vocab_size,
            max_model_len=self.max_model_len,
            device=device,
            tokenizer_dir=self.model,
        )
        self.drafter: LocalDrafter | None = None
        if num_speculative_tokens > 0:
            self.mtp = load_mtp(self.model, dtype=dtype, device=device, load_format=load_format)
            vocab = draft_vocabulary(self.mtp, draft_vocab_size, self.model)
            runner = DrafterRunner(
                self.mtp, self.mtp.make_kv_cache(num_blocks, block_size), tokenizer_dir=self.model, draft_vocab=vocab
            )
            self.drafter = LocalDrafter(runner, device_hand_off=device_hand_off)
        # One scheduler for the LLM's life: what adaptive speculation learns goes on from one generate() to the next.
        self.scheduler = Scheduler(self.scheduler_config, self.eos_token_ids)
        self.step = VerifierStep(worker, self.drafter)  # its drafter: None for target-only steps
        self.engine = Engine(self.scheduler, LocalVerifier(self.step, self.scheduler.eos_token_ids), None)
        self._loop = asyncio.new_event_loop()
        self._tokenizer = None
        self._next_id = 0

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (loaded on first use, never from the network)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model, local_files_only=True)
        return self._tokenizer

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
        ignore_eos: bool = False,
        num_speculative_tokens: int | None = None,
        detokenize: bool = True,
        structured_output: dict | None = None,
    ) -> list[GenerationResult]:
        """One result per prompt (text or token ids), in order, all decoded together in one batch; the
        options are validated as the coordinator validates them (InvalidArgument naming the field).
        `seed`: request i samples with `seed + i` (None: random). `num_speculative_tokens`: drafts per
        iteration of these requests, at most the engine's (None: the engine's). `detokenize=False`: token
        ids only (no text, no tokenizer needed for id prompts; no stop strings). `structured_output`: what every
        output must match, in vLLM's `structured_outputs` shape, as `Client.generate` takes it."""
        if stop and not detokenize:
            raise ValueError("stop strings need detokenize=True")
        spec = None if structured_output is None else structured_output_pb(structured_output)
        requests = []
        for i, prompt in enumerate(prompts):
            msg = coordinator_pb2.GenerateRequest(
                request_id=f"llm-{self._next_id}", max_tokens=max_tokens, stop=stop or [], ignore_eos=ignore_eos
            )
            msg.sampling.temperature, msg.sampling.top_p, msg.sampling.top_k = temperature, top_p, top_k
            if seed is not None:
                msg.sampling.seed = seed + i
            if num_speculative_tokens is not None:
                msg.num_speculative_tokens = num_speculative_tokens
            if spec is not None:
                msg.sampling.structured_output.CopyFrom(spec)
            if isinstance(prompt, str):
                msg.prompt = prompt
            else:
                msg.prompt_token_ids.extend(prompt)
            request = build_request(
                msg,
                tokenizer=self.tokenizer if isinstance(prompt, str) else None,
                vocab_size=self.target.config.vocab_size,
                max_model_len=self.max_model_len,
                num_speculative_tokens=self.num_speculative_tokens,
            )
            self._next_id += 1
            requests.append(request)
        self.engine.tokenizer = self.tokenizer if detokenize else None
        texts = self._loop.run_until_complete(self._run(requests))
        return [self._result(r, t) for r, t in zip(requests, texts)]

    async def _run(self, requests: list[Request]) -> list[str]:
        """The requests through the engine's loop (`Engine.step`, run here until they have finished and what they
        held is freed); their texts. A request that failed raises its error, the others of the call aborted."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        index = {r.request_id: i for i, r in enumerate(requests)}
        texts: list[list[str]] = [[] for _ in requests]
        for request in requests:
            self.engine.add_request(request, queue)
        self.engine.iteration_timings.clear()
        try:
            while self.scheduler.has_work():  # the last iteration only frees what the finished requests held
                await self.engine.step()
                if not self.scheduler.has_work():
                    self.engine.flush_outputs()
                while not queue.empty():
                    out = queue.get_nowait()
                    if out.error is not None:
                        raise out.error
                    texts[index[out.request_id]].append(out.text)
        finally:
            for request in requests:
                self.engine.abort(request.request_id)  # no-op for a finished one
            while self.scheduler.has_work():
                await self.engine.step()
        return ["".join(t) for t in texts]

    @property
    def iteration_timings(self) -> list[IterationTiming]:
        """Where the time of the last generate()'s iterations went (benchmarks)."""
        return list(self.engine.iteration_timings)

    def _result(self, request: Request, text: str) -> GenerationResult:
        return GenerationResult(
            request.request_id,
            list(request.output_token_ids),
            text,
            request.finish_reason or "length",
            request.stats,
            len(request.prompt_token_ids),
            len(request.output_token_ids),
            cached_tokens=request.num_cached_tokens or 0,
        )
