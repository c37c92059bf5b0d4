"""examples/pretrain_gpt_moe.py and examples/check_training.py on CPU, as far as they go without a
GPU (Megatron's pretrain() asserts CUDA): every run's arguments of the check script pass Megatron's
parser and validation with nccl_ep registered; the GPT model Megatron builds from the example's
arguments has MoE layers with NcclEpTokenDispatcher; the datasets provider gives mock samples
inside the vocabulary; the line the example prints per iteration is what the check script reads,
bit for bit; the check script's comparisons catch one differing bit, a crashed run, a resumed run
that started over.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys

import pytest
import torch

import dist
from test_megatron_dispatcher import cuda_streams_on_cpu, megatron_on_cpu

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import check_training  # noqa: E402
import pretrain_gpt_moe  # noqa: E402

CHECKPOINT_DIR = "/nonexistent/checkpoint"  # parsed, never read or written here
RUNS = check_training.run_arguments(CHECKPOINT_DIR)
PARSED = ("moe_token_dispatcher_type", "deterministic_mode", "train_iters", "save", "load",
          "save_interval", "exit_interval", "expert_model_parallel_size", "data_parallel_size",
          "transformer_impl", "nccl_ep_backend", "moe_shared_expert_intermediate_size",
          "moe_shared_expert_overlap", "cuda_graph_impl", "cuda_graph_modules", "num_experts",
          "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "nccl_ep_recv_mode",
          "bf16", "check_for_nan_in_loss_and_grad", "moe_router_force_load_balancing",
          "moe_grouped_gemm", "nccl_ep_capacity_factor")
# The runs of checks f to k and t: the larger model (graphs of whole MoE layers, the grouped
# experts).
GRAPH_RUNS = {name for check in "fghijktu" for name in check_training.CHECK_RUNS[check]}


def flag_value(argv: list, flag: str):
    """The value a command line gives ``flag`` (its last occurrence wins), or None."""
    at = [i for i, a in enumerate(argv) if a == flag]
    return argv[at[-1] + 1] if at else None
LOSS = float(torch.tensor(2.718281828, dtype=torch.float32))  # the loss Megatron logs is float32
GRAD_NORM = 0.1234567890123
DETERMINISM_ENV = ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG")


def example_on_cpu(runs: dict) -> dict:
    """In each of 2 gloo ranks: parses every run's arguments, builds the model and the datasets
    from the example's defaults, and calls the example's per-iteration hook."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.training import training
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.global_vars import unset_global_variables
    from megatron.training.initialize import _compile_dependencies
    from megatron.training.models import GPTModelBuilder

    import megatron_nccl_ep

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))  # as torchrun sets them
    for name in DETERMINISM_ENV:
        os.environ.pop(name, None)
    found = {"parsed": {}}
    # Megatron's validation of --moe-grouped-gemm asks the GPU's compute capability: an sm90's.
    capability = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *_: (9, 0)
    try:
        for name, argv in runs.items():
            args = pretrain_gpt_moe.parse_arguments(argv)
            found["parsed"][name] = {field: getattr(args, field) for field in PARSED}
            unset_global_variables()
    finally:
        torch.cuda.get_device_capability = capability
    # What Megatron's --deterministic-mode sets before NCCL and cuBLAS start.
    found["env"] = {name: os.environ.get(name) for name in DETERMINISM_ENV}
    # Local CUDA graphs: the MoE layers built as MoETransformerLayer (the class whose graph
    # manager knows the moe scopes); without graphs Megatron's own spec.
    for name in ("router_graphs", "nccl_ep"):
        model_config = pretrain_gpt_moe.gpt_config(pretrain_gpt_moe.parse_arguments(RUNS[name]))
        spec = model_config.transformer_layer_spec
        with megatron_on_cpu(ep=world_size):  # (the spec asks for the pipeline's layers)
            found[f"{name}_layers"] = None if spec is None else [
                layer.module.__name__ for layer in spec(model_config).layer_specs]
        unset_global_variables()

    # The model of the default run, and of the shared-expert overlap run (the config Megatron
    # refuses for dispatchers other than alltoall and flex unless register() allowed it).
    # (The last one's arguments stay for the datasets below.)
    for name, extra in (("model", []), ("grouped", ["--moe-grouped-gemm"]),
                        ("shared_expert_overlap", RUNS["shared_expert_overlap"])):
        torch.cuda.get_device_capability = lambda *_: (9, 0)  # (as above)
        try:
            args = pretrain_gpt_moe.parse_arguments(["--use-cpu-initialization", *extra])
        finally:
            torch.cuda.get_device_capability = capability
        # (The shared experts' stream: stand-in streams on CPU.)
        with megatron_on_cpu(ep=world_size), cuda_streams_on_cpu():
            model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
                ProcessGroupCollection.use_mpu_process_groups())
            found[name] = {"type": type(model).__name__, "moe_layers": [
                (isinstance(layer.token_dispatcher, megatron_nccl_ep.NcclEpTokenDispatcher),
                 type(layer.experts).__name__, layer.num_local_experts,
                 layer.shared_experts is not None and layer.shared_expert_overlap)
                for layer in model.modules() if isinstance(layer, MoELayer)]}
        if name != "shared_expert_overlap":
            unset_global_variables()

    # pretrain()'s dataset-helper build, which without the example's workaround exits rank 0.
    pretrain_gpt_moe.use_built_dataset_helpers()
    _compile_dependencies()

    num_samples = training.get_train_valid_test_num_samples()
    train_dataset = pretrain_gpt_moe.datasets_provider(num_samples)[0]
    sample = train_dataset[0]
    found["data"] = {"num_samples": num_samples, "train_length": len(train_dataset),
                     "vocab": args.padded_vocab_size, "seq_length": args.seq_length,
                     **{key: sample[key].tolist() for key in ("tokens", "labels", "loss_mask")}}

    # The hook in front of a stand-in for Megatron's training_log.
    calls = []
    training.training_log = lambda *a, **k: calls.append((a, k)) or "training_log's result"
    pretrain_gpt_moe.print_exact_steps()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = training.training_log({"lm loss": torch.tensor(LOSS)}, {}, 1e-3, 7, 1.0, False,
                                       0, GRAD_NORM, None, 0, None, pg_collection=None)
    found["hook"] = {"printed": printed.getvalue(), "result": result,
                     "passed_on": [(a[3], a[7], sorted(k)) for a, k in calls]}
    return found


@pytest.fixture(scope="module")
def on_cpu():
    # Fresh processes, not the shared pool: parsing sets Megatron's global arguments (which the
    # dispatcher reads) and --deterministic-mode turns on torch's deterministic algorithms.
    ranks = dist.run_isolated(2, example_on_cpu, RUNS, timeout=600)
    failed = [f"rank {r.rank}: {r.outcome()}\n{r.error or ''}" for r in ranks
              if r.error is not None or r.exitcode != 0]
    assert not failed, "\n".join(failed)
    return [r.value for r in ranks]


def test_check_script_arguments_parse_with_nccl_ep_registered(on_cpu):
    for found in on_cpu:
        parsed = found["parsed"]
        assert parsed.keys() == RUNS.keys()
        for name, args in parsed.items():
            iterations = int(flag_value(RUNS[name], "--train-iters"))
            assert args["deterministic_mode"] and args["train_iters"] == iterations, name
            assert (args["num_experts"], args["bf16"]) == (
                (32, True) if name in GRAPH_RUNS else (4, False)), name
            assert args["transformer_impl"] == "local", name
            assert args["expert_model_parallel_size"] == 2, name
            assert args["data_parallel_size"] == 2, name
            dispatcher = "alltoall" if "alltoall" in name else "nccl_ep"
            assert args["moe_token_dispatcher_type"] == dispatcher, name
            assert args["nccl_ep_backend"] == "auto", name
        for name in ("shared_expert_overlap", "shared_expert_overlap_alltoall"):
            assert parsed[name]["moe_shared_expert_intermediate_size"] == 512, name
            assert parsed[name]["moe_shared_expert_overlap"], name
        assert not parsed["nccl_ep"]["moe_shared_expert_overlap"]
        assert parsed["nccl_ep"]["moe_shared_expert_intermediate_size"] is None
        assert (parsed["nccl_ep"]["cuda_graph_impl"], parsed["router_graphs"]["cuda_graph_impl"]) \
            == ("none", "local")
        assert [str(getattr(m, "name", m)) for m in parsed["router_graphs"]["cuda_graph_modules"]] \
            == ["moe_router", "moe_preprocess"], parsed["router_graphs"]["cuda_graph_modules"]
        for name in GRAPH_RUNS:  # the settings each graph check compares
            args = parsed[name]
            modules = [str(getattr(m, "name", m)) for m in args["cuda_graph_modules"]]
            graphs = ("local", ["moe"]) if name.endswith("moe_graphs") else (
                ("full_iteration", []) if name.endswith("full_iteration") else ("none", []))
            assert (args["cuda_graph_impl"], modules) == graphs, (name, args)
            drop_and_pad = "drop_and_pad" in name
            exact = drop_and_pad or name.startswith("eager_exact")
            assert (args["moe_expert_capacity_factor"], args["moe_pad_expert_input_to_capacity"],
                    args["nccl_ep_recv_mode"]) == ((1.0, True, "exact") if drop_and_pad
                                                   else (None, False, "exact") if exact
                                                   else (None, False, "capacity")), (name, args)
            # Check h's capacity-mode runs (SequentialMLP) route balanced; the others route as
            # the model does.
            balanced = name in check_training.CHECK_RUNS["h"]
            assert args["moe_router_force_load_balancing"] == balanced, (name, args)
            grouped = name in ("dropless", "dropless_full_iteration", "redo_full_iteration") \
                or name.endswith("_grouped")
            assert args["moe_grouped_gemm"] == grouped, (name, args)
            assert args["nccl_ep_capacity_factor"] == float(
                flag_value(RUNS[name], "--nccl-ep-capacity-factor") or 2.0), (name, args)
            assert not args["check_for_nan_in_loss_and_grad"], name
        until_save, resumed = parsed["until_save"], parsed["resumed"]
        assert (until_save["save"], until_save["save_interval"], until_save["exit_interval"]) \
            == (CHECKPOINT_DIR, 50, 50)
        assert until_save["load"] is None
        assert (resumed["load"], resumed["save"]) == (CHECKPOINT_DIR, None)
        assert found["env"] == {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        assert found["router_graphs_layers"] == ["MoETransformerLayer"] * 2
        assert found["nccl_ep_layers"] is None


def test_model_has_moe_layers_with_the_nccl_ep_dispatcher(on_cpu):
    for found in on_cpu:
        # 2 layers, 4 experts over EP=2: 2 local experts each, Megatron's local SequentialMLP.
        assert found["model"] == {"type": "GPTModel",
                                  "moe_layers": [(True, "SequentialMLP", 2, False)] * 2}
        # --moe-grouped-gemm under the local spec: nccl_ep's GroupedExperts (register()).
        assert found["grouped"] == {"type": "GPTModel",
                                    "moe_layers": [(True, "GroupedExperts", 2, False)] * 2}
        # The check script's shared-expert overlap run builds, the overlap on in every layer.
        assert found["shared_expert_overlap"] == {
            "type": "GPTModel", "moe_layers": [(True, "SequentialMLP", 2, True)] * 2}


def test_datasets_provider_gives_mock_samples_in_the_vocabulary(on_cpu):
    data = on_cpu[0]["data"]
    assert data["num_samples"] == (100 * 8, 0, 0)  # 100 iterations x 4 sequences x DP 2
    assert data["train_length"] >= 800
    tokens, labels = data["tokens"], data["labels"]
    assert len(tokens) == len(labels) == len(data["loss_mask"]) == data["seq_length"]
    assert tokens[1:] == labels[:-1]  # next-token targets
    assert 0 <= min(tokens + labels) and max(tokens + labels) < data["vocab"]
    assert on_cpu[1]["data"] == data  # the same samples on both ranks (same seed)


def test_last_rank_prints_exact_step_line_the_check_script_reads(on_cpu):
    first, last = (found["hook"] for found in on_cpu)
    for hook in (first, last):
        # Megatron's training_log still runs, with the same arguments, and its result comes back.
        assert hook["result"] == "training_log's result"
        assert hook["passed_on"] == [(7, GRAD_NORM, ["pg_collection"])]
    assert first["printed"] == ""
    assert last["printed"] == pretrain_gpt_moe.step_line(7, LOSS, GRAD_NORM) + "\n"
    steps = check_training.read_steps(last["printed"])
    assert steps == {7: (LOSS.hex(), GRAD_NORM.hex())}
    assert float.fromhex(steps[7][0]) == LOSS and float.fromhex(steps[7][1]) == GRAD_NORM


# ------------------------------------------------------------------------------------------------
# the check script's comparisons, on made-up logs
# ------------------------------------------------------------------------------------------------


def fake_steps(iterations, offset: float = 0.0) -> dict:
    """What read_steps gives for a run: decreasing losses (exact binary fractions, so that the
    differences from ``offset`` are exact) and some gradient norms."""
    return {it: ((7.0 - it / 64 + offset).hex(), (0.5 / it).hex()) for it in iterations}


def log_of(steps: dict) -> str:
    """A run's output: Megatron's own lines around the example's step lines."""
    lines = [" iteration        1/     100 | lm loss: 6.93E+00 | grad norm: 1.2 |"]
    for it, (loss, grad_norm) in steps.items():
        lines.append(pretrain_gpt_moe.step_line(it, float.fromhex(loss), float.fromhex(grad_norm)))
    return "\n".join(lines + ["[after training is done] datetime: 2026-01-01 00:00:00"])


ALLTOALL_OFFSET = 2.0 ** -10  # 9.765625e-4


def good_runs() -> dict:
    every = fake_steps(range(1, 101))
    return {"nccl_ep": (0, every), "nccl_ep_again": (0, dict(every)),
            "alltoall": (0, fake_steps(range(1, 101), offset=ALLTOALL_OFFSET)),
            "until_save": (0, fake_steps(range(1, 51))), "resumed": (0, fake_steps(range(51, 101)))}


def verdicts(runs: dict, tolerance: float = 1e-2) -> list:
    return [passed for _, passed, _ in check_training.checks(runs, tolerance)]


def test_read_steps_finds_only_the_step_lines():
    steps = fake_steps(range(1, 101))
    assert check_training.read_steps(log_of(steps)) == steps


def test_equal_runs_pass_every_check():
    results = check_training.checks(good_runs(), 1e-2)
    assert [passed for _, passed, _ in results] == [True, True, True], results
    assert "largest |loss difference| 9.766e-04" in results[1][2]


def with_lowest_bit_flipped(steps: dict, iteration: int, which: int) -> dict:
    """``steps`` through a log and back, with one value one unit in the last place higher."""
    bits = list(steps[iteration])
    bits[which] = math.nextafter(float.fromhex(bits[which]), math.inf).hex()
    return check_training.read_steps(log_of({**steps, iteration: tuple(bits)}))


@pytest.mark.parametrize("which", [0, 1])  # the loss, the gradient norm
def test_one_bit_fails_determinism_and_resumption(which):
    runs = good_runs()
    runs["nccl_ep_again"] = (0, with_lowest_bit_flipped(runs["nccl_ep"][1], 37, which))
    (_, passed, detail), _, _ = check_training.checks(runs, 1e-2)
    assert not passed and detail.startswith("iteration 37: "), detail
    assert check_training.bitwise_differences(runs["nccl_ep"][1], runs["nccl_ep_again"][1],
                                              range(1, 101)) == [detail]

    runs = good_runs()
    runs["resumed"] = (0, with_lowest_bit_flipped(runs["resumed"][1], 88, which))
    _, _, (_, passed, detail) = check_training.checks(runs, 1e-2)
    assert not passed and detail.startswith("resumed: iteration 88: "), detail
    assert verdicts(runs) == [True, True, False]


def test_resumed_run_that_started_over_fails():
    # It logged 1-100 with the right bits: no checkpoint was loaded.
    runs = good_runs()
    runs["resumed"] = (0, fake_steps(range(1, 101)))
    _, _, (_, passed, detail) = check_training.checks(runs, 1e-2)
    assert not passed and "resumed: logged iterations 1-100 (100), expected 51-100" in detail


def test_missing_iterations_and_crashed_runs_fail():
    runs = good_runs()
    del runs["nccl_ep_again"][1][100]
    assert verdicts(runs) == [False, True, True]
    runs = good_runs()
    runs["until_save"] = (1, runs["until_save"][1])
    assert verdicts(runs) == [True, True, False]
    runs = good_runs()
    runs["nccl_ep"] = (1, {})
    assert verdicts(runs) == [False, False, False]


def test_alltoall_over_the_tolerance_or_nan_fails():
    runs = good_runs()
    assert verdicts(runs, tolerance=ALLTOALL_OFFSET) == [True, True, True]
    assert verdicts(runs, tolerance=ALLTOALL_OFFSET / 2) == [True, False, True]
    runs["alltoall"][1][60] = ("nan", runs["alltoall"][1][60][1])
    _, (_, passed, detail), _ = check_training.checks(runs, 1e-2)
    assert not passed and "largest |loss difference| nan at iteration 60" in detail, detail


def test_shared_expert_overlap_and_graph_checks_compare_their_runs_bitwise():
    runs = good_runs()
    every = fake_steps(range(1, 101))
    runs.update(shared_expert_overlap_alltoall=(0, fake_steps(range(1, 101), offset=0.5)),
                shared_expert_overlap=(0, fake_steps(range(1, 101), offset=0.5)),
                router_graphs=(0, dict(every)))
    results = check_training.checks(runs, 1e-2)
    assert [label[:3] for label, _, _ in results] == ["(a)", "(b)", "(c)", "(d)", "(e)"]
    assert all(passed for _, passed, _ in results), results
    # (d) compares the overlap run with alltoall's overlap run, not with the plain nccl_ep one.
    runs["shared_expert_overlap"] = (
        0, with_lowest_bit_flipped(runs["shared_expert_overlap_alltoall"][1], 9, 1))
    runs["router_graphs"] = (0, with_lowest_bit_flipped(every, 64, 0))
    *_, (_, d_passed, d_detail), (_, e_passed, e_detail) = check_training.checks(runs, 1e-2)
    assert not d_passed and d_detail.startswith("iteration 9: grad norm "), d_detail
    assert not e_passed and e_detail.startswith("iteration 64: loss "), e_detail


def test_only_the_checks_whose_runs_ran():
    runs = {name: run for name, run in good_runs().items() if name in ("nccl_ep", "alltoall")}
    assert [label for label, _, _ in check_training.checks(runs, 1e-2)] == [
        "(b) nccl_ep against alltoall"]
    with pytest.raises(SystemExit):
        check_training.main(["--checks", "az"])


def test_speed_from_megatron_log():
    log = "\n".join([
        "------------------------ arguments ------------------------",
        "  global_batch_size ............................... 8",
        "  seq_length ...................................... 256",
        " [2026-11-30 10:00:00] iteration       10/     100 | elapsed time per iteration (ms): "
        "950.0 | lm loss: 6.9E+00 |",
        *(f" [2026-11-30 10:00:0{i}] iteration       {10 * i}/     100 | elapsed time per "
          f"iteration (ms): {ms} |" for i, ms in ((2, 40.0), (3, 44.0), (4, 41.0))),
    ])
    measured = check_training.speed(log)
    # The first interval (warm-up) left out; median of 40, 44, 41.
    assert measured == {"ms": 41.0, "tokens": 2048, "tokens_per_s": 2048 / 41.0 * 1000.0}
    assert check_training.speed(log.replace("seq_length", "seq_len")) is None
    assert check_training.speed(log.split(" [2026")[0]) is None


def graph_runs(checks: str) -> dict:
    """Passing runs of ``checks`` (their iterations as the check script expects)."""
    return {name: (0, fake_steps(range(1, int(flag_value(RUNS[name], "--train-iters")) + 1)))
            for check in checks for name in check_training.CHECK_RUNS[check]}


def test_graph_checks_compare_bits_and_step_times_against_alltoall():
    runs = graph_runs("fghitu")
    off = dict(runs["capacity_full_iteration"][1])
    off[7] = (float.fromhex(off[7][0]) * (1 + 2 ** -23)).hex(), off[7][1]
    runs["capacity_full_iteration"] = (0, off)  # one bit off at iteration 7
    times = {"alltoall_drop_and_pad_moe_graphs": 500.0, "drop_and_pad_moe_graphs": 480.0,
             "alltoall_drop_and_pad_full_iteration": 140.0, "drop_and_pad_full_iteration": 150.0,
             "dropless_full_iteration": 150.0}
    logs = {"dropless_full_iteration": f"{check_training.HIGH_WATER_LINE} layer 1: 16384 of "
                                       "20480 rows per rank"}
    results = {label[:3]: (passed, detail) for label, passed, detail
               in check_training.checks(runs, 1e-2, times, logs=logs)}
    assert [results[c][0] for c in ("(f)", "(g)", "(h)", "(i)", "(t)", "(u)")] == [
        True, True, False, True, False, True], results
    assert "iteration 7: loss" in results["(h)"][1]
    assert results["(i)"][1].endswith("layer 1: 16384 of 20480 rows per rank"), results["(i)"]
    # 150 / 140 = 1.071: over (g)'s 1.05x, within (u)'s 1.10x for (i)'s run; 480 < 500 for (f).
    assert results["(t)"][1] == (
        "drop_and_pad_full_iteration 150.0 ms = 1.071x alltoall_drop_and_pad_full_iteration "
        "140.0 ms (target <= 1.05x)"), results["(t)"][1]
    times["drop_and_pad_full_iteration"] = 145.0
    assert check_training.checks(runs, 1e-2, times, logs=logs)[-2][1]
    del times["dropless_full_iteration"]
    assert "no step time for dropless_full_iteration" in check_training.checks(
        runs, 1e-2, times, logs=logs)[-1][2]


def test_dropless_check_fails_on_a_redone_step_or_no_high_water_mark():
    runs = graph_runs("i")
    redo = f"{check_training.REDO_LINE} 12: layer 2 needed 20500 ..."
    for logs, problem in (({}, "printed no 'nccl_ep budget high-water mark:' line"),
                          ({"dropless": redo, "dropless_full_iteration":
                            check_training.HIGH_WATER_LINE}, "run dropless redid iterations [12]")):
        [(label, passed, detail)] = check_training.checks(runs, 1e-2, logs=logs)
        assert label.startswith("(i)") and not passed and problem in detail, detail


def test_eager_and_redo_checks():
    runs = graph_runs("jk")
    times = {"eager_exact_grouped": 300.0, "eager_exact_sequential": 800.0,
             "eager_capacity_grouped": 310.0, "eager_capacity_sequential": 290.0}
    logs = {"redo_full_iteration": f"{check_training.REDO_LINE} 1: layer 1 needed ..."}
    results = {label[:3]: (passed, detail) for label, passed, detail
               in check_training.checks(runs, 1e-2, times, logs=logs)}
    assert not results["(j)"][0] and results["(j)"][1] == (
        "eager_capacity_grouped 310.0 ms = 1.069x eager_capacity_sequential 290.0 ms (not "
        "faster)"), results["(j)"]
    assert results["(k)"][0], results["(k)"]
    # The redone step must carry exact mode's bits, and be the only one redone.
    redo = dict(runs["redo_full_iteration"][1])
    runs["redo_full_iteration"] = (0, with_lowest_bit_flipped(redo, 1, 1))
    assert "iteration 1: grad norm" in dict(
        (label[:3], detail) for label, _, detail in check_training.checks(
            runs, 1e-2, times, logs=logs))["(k)"]
    runs["redo_full_iteration"] = (0, redo)
    logs["redo_full_iteration"] += f"\n{check_training.REDO_LINE} 40: layer 1 needed ..."
    assert "redid iterations [1, 40], expected [1]" in dict(
        (label[:3], detail) for label, _, detail in check_training.checks(
            runs, 1e-2, times, logs=logs))["(k)"]


def test_runs_compared_bitwise_must_have_trained():
    # Two runs of NaN losses (or of no training) are equal bit for bit: that passes no check.
    nan = {it: ("nan", (0.5).hex()) for it in range(1, 101)}
    flat = {it: ((7.0).hex(), (0.5).hex()) for it in range(1, 101)}
    for steps, problem in ((nan, "loss not finite at iterations 1-100 (100)"),
                           (flat, "the loss did not go down")):
        runs = {"nccl_ep": (0, steps), "nccl_ep_again": (0, dict(steps))}
        [(_, passed, detail)] = check_training.checks(runs, 1e-2)
        assert not passed and problem in detail, detail


def test_graphed_runs_that_captured_nothing_fail_their_checks():
    # Megatron leaves a module list it does not know uncaptured, silently: a graphed run must
    # log the example's capture line, or its check (bits equal to the reference) proves nothing.
    assert check_training.GRAPHS_LINE == pretrain_gpt_moe.GRAPHS_LINE
    runs = graph_runs("fgh")
    captured = {"drop_and_pad_full_iteration", "capacity_full_iteration"}
    results = {label[:3]: (passed, detail) for label, passed, detail in
               check_training.checks(runs, 1e-2, captured=captured)}
    assert [results[c][0] for c in ("(f)", "(g)", "(h)")] == [False, True, True], results
    assert "run drop_and_pad_moe_graphs captured no CUDA graph" in results["(f)"][1]
    assert all(passed for _, passed, _ in check_training.checks(good_runs(), 1e-2, captured=set()))


def test_megatron_lm_script_runs_through_the_runner_and_is_recorded(tmp_path, monkeypatch):
    # Every run of the check starts Megatron-LM's script through examples/run_megatron_lm.py
    # (the launcher, with the example's defaults and step lines) when one is named.
    script = tmp_path / "pretrain_gpt.py"
    assert check_training.train_command(["--x"], 2)[-2:] == [check_training.EXAMPLE, "--x"]
    command = check_training.train_command(["--x"], 2, str(script))
    assert command[-3:] == [check_training.MEGATRON_LM_RUNNER, str(script), "--x"]
    assert os.path.isfile(check_training.MEGATRON_LM_RUNNER)
    with pytest.raises(SystemExit):  # a script that is not there: refused before any run
        check_training.main(["--checks", "a", "--megatron-lm-script", str(script)])
    # --json: the checks, each run's step time, the sources hash of the tree, the command.
    script.write_text("")
    monkeypatch.setattr(check_training, "device_name", lambda: "GPU X")
    calls = []

    def train(name, arguments, gpus, workdir, timeout, megatron_lm_script):
        calls.append(megatron_lm_script)
        steps = fake_steps(range(1, check_training.ITERATIONS + 1))
        return 0, steps, {"ms": 40.0, "tokens": 2048, "tokens_per_s": 51200.0}, False, ""

    monkeypatch.setattr(check_training, "train", train)
    out = tmp_path / "training.json"
    argv = ["--checks", "a", "--gpus", "1", "--workdir", str(tmp_path), "--json", str(out),
            "--megatron-lm-script", str(script)]
    assert check_training.main(argv) == 0
    assert calls == [str(script)] * 2
    from benchmarks.report import source_version

    record = json.loads(out.read_text())
    assert record["source"] == source_version() and record["device"] == "GPU X"
    assert record["script"] == "Megatron-LM's pretrain_gpt.py"
    assert record["command"] == "python examples/check_training.py " + " ".join(argv)
    assert [c["passed"] for c in record["checks"]] == [True]
    assert record["runs"]["nccl_ep_again"] == {"exit_status": 0, "iterations": 100,
                                              "graphs": False, "ms": 40.0, "tokens": 2048,
                                              "tokens_per_s": 51200.0}
