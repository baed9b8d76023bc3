"""benchmarks/serve_profile.py's split of py-spy samples (its raw format: 'frame;frame;... count',
the thread first, native frames as addresses) into the categories its table reports."""
from __future__ import annotations

from typing import Any

import pytest

from tests.benchmarks.test_bench import _load_script

BUSY_LOOP = ("thread (13980): MainThread;0x7fe1e264524a (libc.so.6);<module> (<string>:1);"
             "run_engine_core (kvserve/engine/core_proc.py:473);"
             "EngineCoreProc.run_busy_loop (kvserve/engine/core_proc.py:202)")
STEP = BUSY_LOOP + (";EngineCoreProc._process_engine_step (kvserve/engine/core_proc.py:217);"
                    "EngineCore.step (kvserve/engine/core.py:94)")
OUTPUT_IO = ("thread (14041): EngineCoreOutputIO;thread_run (libpython3.11.so.1.0);"
             "EngineCoreProc.process_output_sockets (kvserve/engine/core_proc.py:372)")
SAMPLES = [
    (BUSY_LOOP + ";EngineCoreProc._process_input_queue (kvserve/engine/core_proc.py:208);"
                 "Queue.get (queue.py:171)", 30),
    # The LM head's matmul runs through a linear op: it counts as the LM head, not a linear layer.
    (STEP + ";LlamaForCausalLM.compute_logits (kvserve/model/llama.py:200);"
            "ParallelLMHead.compute_logits (kvserve/model/layers/embedding.py:98);"
            "LinearBase.apply_linear (kvserve/model/layers/linear.py:115)", 10),
    (STEP + ";LlamaForCausalLM.forward (kvserve/model/llama.py:191);"
            "LlamaMLP.forward (kvserve/model/llama.py:60);"
            "LinearBase.apply_linear (kvserve/model/layers/linear.py:115);"
            "mkldnn_linear_pointwise (libtorch_cpu.so)", 40),
    (STEP + ";LlamaForCausalLM.forward (kvserve/model/llama.py:191);"
            "RotaryEmbedding.forward (kvserve/model/layers/rotary.py:80)", 10),
    (STEP + ";Scheduler.schedule (kvserve/core/scheduler.py:200)", 10),
    (OUTPUT_IO + ";Queue.get (queue.py:171)", 90),
    (OUTPUT_IO + ";Socket.send_multipart (zmq/sugar/socket.py:700)", 10),
]


def test_split_shares_per_category(tmp_path: Any) -> None:
    sp = _load_script("serve_profile")
    raw = tmp_path / "core.txt"
    raw.write_text("".join(f"{stack} {n}\n" for stack, n in SAMPLES))
    main = sp.split(str(raw), "MainThread", sp.ENGINE_MAIN)
    assert main == pytest.approx({"idle (waiting for requests)": 0.3, "LM head": 0.1,
                                  "forward: linear layers": 0.4,
                                  "forward: other kernels (KV write, rotary, silu, norms)": 0.1,
                                  "scheduler": 0.1})
    io = sp.split(str(raw), "EngineCoreOutputIO", [("idle", ("Queue.get",))])
    assert io == pytest.approx({"idle": 0.9, "other": 0.1})
    assert sp.split(str(raw), "NoSuchThread", sp.ENGINE_MAIN) == {}
