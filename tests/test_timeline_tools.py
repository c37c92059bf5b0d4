"""The GPU machine's host-path tools work on a CPU too, where what they wrap is plain Python:
``megatron_timeline.py --host-calls`` times the calls of a step and puts every wrapped function
back (torch's among them), and ``megatron_ab.py`` loads a baseline tree's package beside ours."""

from __future__ import annotations

import os
import sys

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

cuda_backend = pytest.importorskip("megatron_nccl_ep.cuda_backend")
if not cuda_backend.available():
    pytest.skip(f"the timeline tools wrap the extension's calls: {cuda_backend.unavailable_reason()}",
                allow_module_level=True)

import megatron_timeline  # noqa: E402  (benchmarks/, after the path)


class StandInDispatcher:
    """The two methods the step below calls, each calling a traced torch function."""

    def dispatch_preprocess(self, n):
        return torch.empty(n)

    def token_dispatch(self, x):
        return torch.empty(x.shape[0] + 1)


def test_host_calls_times_a_step_and_restores_what_it_wrapped(capsys):
    dispatcher = StandInDispatcher()
    traced = megatron_timeline.traced_calls(dispatcher)
    before = [(owner, name, vars(owner).get(name)) for owner, name in traced]

    def step(i, mark):
        with mark("dispatch_preprocess"):
            x = dispatcher.dispatch_preprocess(3 + i % 2)
        with mark("token_dispatch"):
            dispatcher.token_dispatch(x)

    megatron_timeline.host_calls(step, 5, dispatcher)
    lines = capsys.readouterr().out.splitlines()
    labels = [line.split(None, 3)[3] for line in lines[1:]]  # after start, end, duration
    assert labels == ["StandInDispatcher.dispatch_preprocess", "torch.empty",
                      "StandInDispatcher.token_dispatch", "torch.empty #2"], lines
    after = [(owner, name, vars(owner).get(name)) for owner, name in traced]
    for (owner, name, own), (_, _, again) in zip(before, after):
        assert again is own, f"{owner}.{name} was not put back"
    assert not vars(dispatcher), "the dispatcher keeps a wrapper"


def test_megatron_ab_loads_a_baseline_package_on_our_extension():
    import megatron_ab

    package = megatron_ab.load_baseline(REPO_ROOT)
    dispatcher_cls = package.NcclEpTokenDispatcher
    assert dispatcher_cls.__module__ == "megatron_nccl_ep_baseline.dispatcher"
    assert dispatcher_cls is not __import__("megatron_nccl_ep").NcclEpTokenDispatcher
    assert sys.modules["megatron_nccl_ep_baseline._C"] is cuda_backend._C


def test_team_bench_times_an_op_from_the_last_rank_in():
    import team_bench  # benchmarks/, after the path

    # Rank 1 enqueued 2 us late; rank 0 then waited for it, and both ended within 1 us.
    iterations = [[(0.0, 10.0), (2.0, 11.0)], [(0.0, 7.0), (0.5, 7.5)], [(1.0, 9.0), (0.0, 8.0)]]
    collective, busy, fastest = team_bench.summarize(iterations)
    assert collective == 8.0  # 9.0, 7.0, 8.0: the last start to the last end
    assert busy == 8.0  # 10, 9, 7, 7, 8, 8
    assert fastest == 7.0
