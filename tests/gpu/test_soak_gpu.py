"""Soak, GPU form (``pytest -m gpu``): 8 threads x thousands of random calls on CUDA, small caches,
Document ids rewritten in place on the device between calls, every result vs the float64
reference, memory flat over the run.

The machinery is the CPU form's (``tests/soak_harness.py``, whose docstring says what each kind
of call does; ``tests/property/test_soak.py`` is the CPU form); ``soak_harness.gpu_form_config``
sets the GPU form up:

* routes: every kind runs on ``backend="auto"`` (which picks SDPA / cuDNN / varlen / Triton flex,
  or FA4 / flex_flash where flash-attn-4 is installed) or on a named route (``flex``, ``varlen``,
  ``sdpa_cudnn``) where ``fz.plan`` says it accepts the call; the routes that actually ran are
  counted and printed;
* bf16 and fp16, compared with ``fz.testing.assert_matches_reference`` (the project's tolerance
  rule, as in test_routes_gpu.py: at most 2x the error of eager attention in the input dtype, plus
  a floor);
* registry specs come from a fixed pool of 8 draws (spec, length, batch, dtype; drawn once from
  the seed) so the Triton compiles stay bounded; round 0 (the coverage round) runs every
  (kind, causal, dtype, route, pool entry) combination once, so every kernel compiles there;
  rounds 1-3 are random warm-up rounds, whose last memory samples are the reference for rounds 4-11;
* threads: 8 persistent threads (the same ones every round, parked on a barrier in between, so
  per-thread cuBLAS / cuDNN handles and workspaces are made once). Streams: by default every
  thread uses the device's **default stream** (``FLEXATTN_ZOO_SOAK_STREAMS=default``): calls from
  all threads are ordered on the GPU in launch order, which is the setting the library's caches
  are written for (a cached BlockMask, spec tensor or cu_seqlens is filled on the stream of the
  call that built it). ``FLEXATTN_ZOO_SOAK_STREAMS=thread`` gives each thread its own
  ``torch.cuda.Stream`` instead: that also exercises cross-stream reuse of cached device tensors
  (built on one thread's stream, read on another's), which nothing in the library orders today,
  so read a failure there as a finding about that, not as a regression;
* memory: after every round (``gc.collect()``, ``torch.cuda.synchronize()``),
  ``torch.cuda.memory_allocated()`` must stay within ``DEVICE_ALLOC_GROWTH_BOUND_MB`` of the last
  warm-up round's value, the number of objects Python's garbage collector tracks within
  ``object_growth_bound`` (half an object per call after warm-up: a per-call leak of specs, plans,
  closures or tensors), and the resident set size (sampled after glibc's ``malloc_trim``, so it
  follows live host memory rather than what the allocator keeps) within ``RSS_GROWTH_BOUND_MB_GPU``,
  a coarse backstop for host memory outside Python's objects;
  ``max_memory_allocated`` (each round's peak) and ``memory_reserved`` are reported (bounds and
  checks: ``soak_harness.gpu_form_soak``). A compile
  after warm-up (``compiles after each round`` in the report) would say round 0 missed a kernel.

Knobs (environment): ``FLEXATTN_ZOO_SOAK_CALLS`` random calls in all (default 10000, spread over
8 threads x 11 random rounds; the coverage round adds ~40), ``FLEXATTN_ZOO_SOAK_STREAMS``
(``default`` | ``thread``), ``FLEXATTN_ZOO_SOAK_SUMMARY=path.json`` writes the numbers as JSON
(``benchmarks/gpu_tests.sh`` sets it). ``-s`` prints them: calls by kind and by route, wall time
per round, compiles per round, RSS and device memory per round.
"""

from __future__ import annotations

import pytest
import torch
from soak_harness import gpu_form_soak  # tests/soak_harness.py (tests/ is on sys.path via conftest)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_soak_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_form_soak(monkeypatch, device="cuda")
