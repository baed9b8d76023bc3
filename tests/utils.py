"""Helpers shared by the tests: Hugging Face references, output comparisons, and a real
`kvserve serve` subprocess (RemoteServer)."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import httpx
import torch

from kvserve.outputs import RequestOutput
from kvserve.worker.cuda_graph import CUDAGraphRunner

# Float32 comparisons against transformers: summation order differs, nothing else.
LOGPROB_ATOL = 2e-3


def peaked_copy(src: str, out: str, scale: float = 5.0) -> str:
    """Copy checkpoint `src` into `out` with its LM head scaled by `scale`: next-token
    distributions become peaked (a few likely tokens), so a wrong sampling or search rule
    shows (a random model's near-uniform distribution would hide it)."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), out)
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * scale
    save_file(tensors, path, metadata={"format": "pt"})
    return out


def kernel_isa_prefix() -> str:
    """How the compiled kernels' `*_isa()` strings start for the selected ISA tier."""
    from kvserve.ops import cpu_isa
    tier = cpu_isa.selected_tier()
    return "avx512" if tier and tier.startswith("avx512") else str(tier)


def random_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the special ids (0..4) so prompts look like text.
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def hf_greedy(model_path: str, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy tokens and per-step raw log-softmax from transformers, one prompt at a time
    (no padding, so nothing but the model itself is being compared)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0, eos_token_id=None, min_new_tokens=max_new_tokens)
            tokens = out.sequences[0, len(ids):].tolist()
            logprobs = [torch.log_softmax(l[0].float(), dim=-1) for l in out.logits]
            results.append((tokens, logprobs))
    return results


def hf_prompt_logprobs(model_path: str, prompt: list[int]) -> torch.Tensor:
    """[P-1] logprob of prompt token t+1 given tokens ..t, from transformers."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def check_greedy_close(ref_tokens: list[int], ref_logprobs: Optional[list[torch.Tensor]],
                       out: RequestOutput, name: str = "", top: int = 5) -> int:
    """Greedy tokens equal; where they first differ (a near-tie under rounding), each side's
    token must be in the other's top-`top`. Returns the number of positions that matched."""
    ours = out.outputs[0].token_ids
    our_lps = out.outputs[0].logprobs
    n = min(len(ours), len(ref_tokens))
    for i in range(n):
        if ours[i] == ref_tokens[i]:
            if ref_logprobs is not None and our_lps is not None:
                got = our_lps[i][ours[i]].logprob
                want = ref_logprobs[i][ref_tokens[i]].item()
                assert abs(got - want) < LOGPROB_ATOL, f"{name} pos {i}: logprob {got} vs HF {want}"
            continue
        # First divergence: only acceptable as a near-tie.
        assert ref_logprobs is not None and our_lps is not None, \
            f"{name}: tokens differ at {i}: {ours[i]} vs HF {ref_tokens[i]}"
        ref_top = torch.topk(ref_logprobs[i], top).indices.tolist()
        assert ours[i] in ref_top, f"{name} pos {i}: our token {ours[i]} not in HF top-{top} {ref_top}"
        assert ref_tokens[i] in our_lps[i], \
            f"{name} pos {i}: HF token {ref_tokens[i]} not in our top logprobs {list(our_lps[i])}"
        return i
    assert len(ours) == len(ref_tokens), f"{name}: lengths {len(ours)} vs {len(ref_tokens)}"
    return n


def greedy_prefix_near_tie(a: Any, b: Any, name: str = "") -> int:
    """Two kvserve runs' greedy CompletionOutputs (with logprobs): tokens equal up to a first
    difference where each side's token is among the other's returned logprobs (a near-tie, the
    rule check_greedy_close applies against HF). Returns the number of equal tokens."""
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            assert x in b.logprobs[i] and y in a.logprobs[i], \
                f"{name} pos {i}: {x} vs {y}, top logprobs {a.logprobs[i]} / {b.logprobs[i]}"
            return i
    return min(len(a.token_ids), len(b.token_ids))


def assert_same_outputs(a: list[RequestOutput], b: list[RequestOutput], what: str) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.token_ids == cy.token_ids, f"{what}: request {i} differs"
            assert cx.text == cy.text
            assert cx.finish_reason == cy.finish_reason


def scattered_paged_cache(token_counts: list[int], num_kv_heads: int, head_dim: int,
                          block_size: int, dtype: torch.dtype, pad_blocks: int,
                          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged KV cache [2, NB, BS, Hkv, D] and block tables [N, max blocks + pad_blocks] for
    sequences of `token_counts` tokens, as the attention kernels see them in the engine: each
    sequence's blocks scattered through the cache out of order, the table padded with ids of
    blocks nobody owns, and every slot no sequence owns (other blocks, the tail of a last
    block) NaN, so that reading one shows in the result."""
    needed = [(n + block_size - 1) // block_size for n in token_counts]
    num_blocks = sum(needed) + 5                        # 5 blocks nobody owns
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                           generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)    # scattered, out of order
    owned, unused = perm[:sum(needed)], perm[sum(needed):]
    kv_cache[:, unused] = float("nan")
    tables = unused[torch.randint(len(unused), (len(token_counts), max(needed) + pad_blocks),
                                  generator=gen)]
    used = 0
    for i, (n, nb) in enumerate(zip(token_counts, needed)):
        tables[i, :nb] = owned[used:used + nb]
        used += nb
        kv_cache[:, tables[i, nb - 1], n - (nb - 1) * block_size:] = float("nan")
    return kv_cache, tables


# ---------------------------------------------------------------------- servers
# The engine flags every test server uses: small, float32, deterministic.
SERVER_ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256",
                      "--kv-cache-memory", "16777216"]
MAX_MODEL_LEN = 256
STARTUP_TIMEOUT_S = 300.0   # a loaded shared machine builds or loads the C++ kernels slowly


class _Replay:
    """A captured graph's stand-in on CPU: replay() runs the bucket's code eagerly over the
    runner's static buffers and writes the output the 'capture' returned, in place."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward
        self.out = forward().clone()

    def replay(self) -> None:
        self.out.copy_(self.forward())


class EmulatedGraphs(CUDAGraphRunner):
    """CUDAGraphRunner whose captures are _Replay objects (CPU): the buckets, the staging into
    the static buffers, the padding, which bucket a step takes are the runner's own. With LoRA
    a replay first restores the LoRA state its bucket was captured in (the static mapping, or
    none for a plain graph), as a real graph holds it."""

    def _capture_one(self, mixed: bool, b: int) -> tuple[_Replay, torch.Tensor]:
        lora_on = self.lora is not None and self.lora.mapping.static

        def forward() -> torch.Tensor:
            if self.lora is not None and lora_on:
                self.static_inputs(b)
            elif self.lora is not None:
                self.lora.mapping.clear()
            return self._forward(mixed, b)

        graph = _Replay(forward)
        return graph, graph.out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m kvserve.entrypoints.cli serve MODEL --host 127.0.0.1 --port P ...`, started
    in its own session (so teardown can reach the engine core process it spawns)."""

    def __init__(self, model: str, args: list[str], startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
        self.model = model
        self.args = args
        self._log = tempfile.NamedTemporaryFile(prefix="kvserve-server-", suffix=".log", delete=False)
        self.proc: Optional[subprocess.Popen] = None
        for _ in range(3):   # another process may grab the free port first: try another
            self.port = _free_port()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", model,
                 "--host", "127.0.0.1", "--port", str(self.port), *args],
                stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
            if self._wait_healthy(startup_timeout):
                return
            if "Cannot listen on" not in self.log_text():
                break
        log = self.log_text()
        self.kill()
        raise RuntimeError(f"kvserve serve did not become healthy:\n{log[-4000:]}")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url_v1(self) -> str:
        return self.base_url + "/v1"

    def url_for(self, path: str) -> str:
        return self.base_url + "/" + path.lstrip("/")

    def log_text(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def _wait_healthy(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url_for("/health"), timeout=2.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def terminate(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM and wait; returns the exit code (None if it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is None:
            return
        try:   # the whole session: the server and the engine core process it started
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)

    def session_alive(self) -> bool:
        """Whether any process of the server's session (engine core included) is left."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        self.terminate()
        self.kill()
        os.unlink(self._log.name)
