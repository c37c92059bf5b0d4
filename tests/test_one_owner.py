"""One owner per rule (docs/design.md §1, "Where to change what"): every default, bound and number
of the contract that the C library and Python both use is written once, in
csrc/include/nccl_ep_limits.h; Python reads it (megatron_nccl_ep/limits.py) with the values the C
compiler gives them; the old copies of those values do not come back in the product's sources;
the cuda backend's configuration checks are the library's, and the reference backend's copy of
them refuses and accepts the same bounds; the LL dispatch outputs' order is outputs.py's; a
payload dtype is data."""

import pathlib
import re
import shutil
import subprocess
import tokenize

import pytest
import torch

import megatron_nccl_ep as ep
from megatron_nccl_ep import config, cuda_backend, fp8, limits, ll_reference, options, outputs

ROOT = pathlib.Path(ep.__file__).parent.parent
HEADER = ROOT / "csrc" / "include" / "nccl_ep_limits.h"
needs_library = pytest.mark.skipif(not cuda_backend.available(),
                                   reason=f"CUDA library not built: "
                                          f"{cuda_backend.unavailable_reason()}")


# -- the header and Python's values ---------------------------------------------------------------
def _macro_names() -> list:
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    return [n for n in re.findall(r"^#define\s+NCCL_EP_([A-Z0-9_]+)\b", text, re.M)
            if n != "LIMITS_H_"]


def test_the_reader_takes_every_macro_of_the_header():
    """No macro of the header is left out by limits.py's reader (a form it cannot read would
    silently be missing in Python)."""
    assert sorted(_macro_names()) == sorted(limits._VALUES)


def test_python_holds_the_values_the_c_compiler_gives_the_macros(tmp_path):
    """A C program compiled against the header prints every macro (floats as C's exact hex
    form): Python's values are those, bit for bit."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) here")
    names = _macro_names()
    prints = "\n".join(f'  printf("{n} %a\\n", (double)(NCCL_EP_{n}));' for n in names)
    source = tmp_path / "limits.c"
    source.write_text(f'#include <stdio.h>\n#include "{HEADER}"\nint main(void) {{\n{prints}\n'
                      "  return 0;\n}\n")
    binary = tmp_path / "limits"
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", str(source), "-o", str(binary)],
                   check=True)
    printed = dict(line.split() for line in subprocess.run(
        [str(binary)], check=True, capture_output=True, text=True).stdout.splitlines())
    for name in names:
        assert float.fromhex(printed[name]) == limits._VALUES[name], name


def test_the_modules_use_the_header_values():
    values = limits._VALUES
    assert (config.LL_MAX_TOKENS, config.LL_MAX_TOPK, config.LL_MAX_EXPERTS,
            config.LL_PACK_ELEMS) == (values["LL_MAX_TOKENS"], values["LL_MAX_TOPK"],
                                      values["LL_MAX_EXPERTS"], values["LL_PACK_ELEMS"])
    assert config.GroupConfig.num_sms == options.NcclEpOptions.num_sms == values["DEFAULT_NUM_SMS"]
    assert config.GroupConfig.timeout_s == options.NcclEpOptions.timeout_s == (
        values["DEFAULT_TIMEOUT_MS"] / 1000)
    assert (fp8.FP8_BLOCK, fp8.FP8_MAX, fp8.FP8_AMAX_FLOOR) == (
        values["FP8_BLOCK"], values["FP8_MAX"], values["FP8_AMAX_FLOOR"])
    assert config.LL_PAYLOADS[torch.float8_e4m3fn].scale_block == values["FP8_BLOCK"]
    # What the numbers are (docs/design.md §9): e4m3's largest finite value, 1e-4 in float32.
    assert values["FP8_MAX"] == torch.finfo(torch.float8_e4m3fn).max
    assert values["FP8_AMAX_FLOOR"] == torch.tensor(1e-4, dtype=torch.float32).item()
    from megatron_nccl_ep import ll as ll_front

    assert ll_front.LL_BUFFER_SETS == values["LL_BUFFER_SETS"]


# -- no second copy in the sources ----------------------------------------------------------------
def _c_code(path: pathlib.Path) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", path.read_text(), flags=re.S)


def _python_code(path: pathlib.Path) -> str:
    """The file without its comments and docstrings (strings that are a statement)."""
    with open(path, "rb") as f:
        tokens = list(tokenize.tokenize(f.readline))
    kept, previous = [], tokenize.NEWLINE
    for tok in tokens:
        docstring = (tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.NL,
                                                                  tokenize.INDENT,
                                                                  tokenize.DEDENT,
                                                                  tokenize.ENCODING))
        if tok.type != tokenize.COMMENT and not docstring:
            kept.append(tok.string)
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return " ".join(kept)


def _product_sources() -> dict:
    """{path relative to the root: its code}, the package's Python and the C/CUDA sources; the
    limits header (the owner) left out."""
    found = {}
    for path in sorted((ROOT / "megatron_nccl_ep").glob("*.py")):
        found[str(path.relative_to(ROOT))] = _python_code(path)
    for ext in ("h", "cc", "cu", "cuh"):
        for path in sorted((ROOT / "csrc").rglob(f"*.{ext}")):
            if path != HEADER:
                found[str(path.relative_to(ROOT))] = _c_code(path)
    return found


# (what, pattern of an old copy, the files it may not appear in: path prefixes, "" for all). Each
# pattern is how the value was written before it moved to the header, or an obvious new copy.
OLD_COPIES = [
    ("FP8 max", r"(?<![\w.])448(\.0*)?f?\b", ""),
    ("FP8 amax floor", r"(?<![\w.])(1(\.0*)?e-0*4f?|0\.0001f?)\b",
     ("csrc/", "megatron_nccl_ep/fp8.py", "megatron_nccl_ep/config.py",
      "megatron_nccl_ep/ll_reference.py")),
    ("FP8 block", r"[/%]\s*128\b", ""),
    ("LL pack of 8", r"kLLGroupElems\s*=\s*8\b|hidden\s*%\s*8\b", ""),
    ("LL pack of 8 in the LL kernels", r"(float\s+\w+\s*(\[\w+\])?\[8\]|q\s*<\s*8\b|"
                                       r"\b8\s*\*\s*sizeof)", "csrc/kernels/ll_"),
    ("LL buffer sets", r"epoch\s*&\s*1\b|epoch\s*[->]\s*2\b|\(\s*epoch\s*\+\s*1\s*\)\s*/\s*2\b|"
                       r"\*\s*2\s*\+\s*set\b", ""),
    ("LL buffer sets in the window plan", r"\b2\s*\*\s*(R|Tm)\b|\*\s*2\s*\*\s*R\b",
     "csrc/runtime/config.cc"),
    ("LL buffer sets in the in-flight rule", r"size\(\)\s*<\s*2\b|op\s*\+\s*2\b",
     "csrc/runtime/ll.cc"),
    ("LL buffer sets in the in-flight rule", r"(>=|<=|\+)\s*2\b", "megatron_nccl_ep/ll.py"),
    ("SM ceiling", r"kMaxChannels\s*=\s*\d|num_sms\s*<=\s*\d", ""),
    ("staging depth", r"staging_depth\s*(>=|<=|<|>)\s*[1-9]|kDefaultDepth\s*=\s*\d|"
                      r"staging_chunk_tokens\s*<=\s*\(?\d", ""),
    ("group size", r"kMaxRanks\s*=\s*\d", ""),
    ("HT expert count and alignment", r"65535|1\s*<<\s*20\b", ""),
    ("slots per rank", r"kMaxTopk\s*=\s*\d", ""),
    ("LL bounds", r"(max_tokens_per_rank|T_max|max_topk|num_experts)\s*<=\s*\d", ""),
    ("the FP8 payload as a bool", r"dispatch_fp8|\bint\s+fp8\b|\.fp8\b", ""),
    ("the LL outputs' count in the bindings", r"kLLFields\s*=\s*\d", ""),
]


@pytest.mark.parametrize("what, pattern, where", OLD_COPIES, ids=[c[0] for c in OLD_COPIES])
def test_no_second_copy_of_a_header_value(what, pattern, where):
    found = [f"{path}: {m.group(0)!r}" for path, code in _product_sources().items()
             if path.startswith(where) for m in re.finditer(pattern, code)]
    assert not found, f"{what} written outside nccl_ep_limits.h: {found}"


def test_the_c_sources_take_the_values_from_the_header():
    protocol = _c_code(ROOT / "csrc" / "kernels" / "protocol.cuh")
    for name, macro in [("kMaxRanks", "MAX_RANKS"), ("kMaxChannels", "MAX_NUM_SMS"),
                        ("kMaxTopk", "MAX_SLOTS_PER_RANK"), ("kLLGroupElems", "LL_PACK_ELEMS"),
                        ("kLLSets", "LL_BUFFER_SETS"), ("kFp8Block", "FP8_BLOCK"),
                        ("kFp8Max", "FP8_MAX"), ("kFp8AmaxFloor", "FP8_AMAX_FLOOR")]:
        assert re.search(rf"\b{name}\s*=\s*NCCL_EP_{macro}\s*;", protocol), name
    # The LL kernels use the set rule, the cast the header's constants.
    for kernel in ("ll_dispatch.cu", "ll_combine.cu"):
        code = _c_code(ROOT / "csrc" / "kernels" / kernel)
        assert "ll_set(epoch)" in code and "epoch - kLLSets" in code, kernel
    dispatch = _c_code(ROOT / "csrc" / "kernels" / "ll_dispatch.cu")
    assert "kFp8AmaxFloor" in dispatch and "kFp8Max" in dispatch


def test_one_in_flight_rule_per_language():
    """The LL buffer sets' rule is written once in C (ll.cc check_op) and once in Python
    (ll.InFlight.check_room), both driven by the header's count."""
    ll_cc = _c_code(ROOT / "csrc" / "runtime" / "ll.cc")
    assert ll_cc.count("kLLSets") >= 2 and "check_op" in ll_cc
    ll_py = (ROOT / "megatron_nccl_ep" / "ll.py").read_text()
    assert ll_py.count("LL_BUFFER_SETS") >= 3
    # Nowhere else in the Python package.
    others = [p for p, code in _product_sources().items() if p.endswith(".py")
              and p != "megatron_nccl_ep/ll.py" and "LL_BUFFER_SETS" in code
              and p != "megatron_nccl_ep/limits.py"]
    assert not others, others


# -- the configuration checks: the library's, and the reference's copy ----------------------------
BASE = dict(num_experts=8, hidden=256, max_tokens_per_rank=16, max_topk=2)
LL = dict(BASE, mode="ll")
FP8 = torch.float8_e4m3fn
# (fields, world size): configurations at a bound of the header, accepted, and just past it.
AT_BOUND = [
    (dict(BASE, num_sms=limits.MAX_NUM_SMS), 2),
    (dict(BASE, staging_depth=limits.MAX_STAGING_DEPTH), 2),
    (dict(BASE, staging_depth=limits.MIN_STAGING_DEPTH), 2),
    (dict(BASE, staging_chunk_tokens=limits.MAX_STAGING_CHUNK_TOKENS), 2),
    (dict(LL, max_tokens_per_rank=limits.LL_MAX_TOKENS), 2),
    (dict(LL, num_experts=limits.LL_MAX_EXPERTS, max_topk=limits.LL_MAX_TOPK), 2),
    (dict(LL, hidden=limits.LL_PACK_ELEMS), 2),
    (dict(LL, hidden=limits.FP8_BLOCK, payload_dtype=FP8), 2),
    (dict(BASE, recv_mode="capacity", expert_capacity=3, expert_alignment=8), 4),
    (dict(BASE, recv_mode="capacity", max_recv_tokens_per_rank=40, rail_capacity=16), 2),
    (dict(BASE, recv_mode="capacity", max_recv_tokens_per_rank=40, rail_capacity=1), 2),
]
PAST_BOUND = [
    (dict(BASE, num_sms=limits.MAX_NUM_SMS + 1), 2),
    (dict(BASE, staging_depth=limits.MAX_STAGING_DEPTH + 1), 2),
    (dict(BASE, staging_depth=limits.MIN_STAGING_DEPTH - 1), 2),
    (dict(BASE, staging_chunk_tokens=limits.MAX_STAGING_CHUNK_TOKENS + 1), 2),
    (dict(LL, max_tokens_per_rank=limits.LL_MAX_TOKENS + 1), 2),
    (dict(LL, num_experts=limits.LL_MAX_EXPERTS + 2), 2),
    (dict(LL, max_topk=limits.LL_MAX_TOPK + 1, num_experts=64), 2),
    (dict(LL, hidden=limits.LL_PACK_ELEMS * 3 // 2), 2),
    (dict(LL, hidden=limits.FP8_BLOCK + limits.LL_PACK_ELEMS, payload_dtype=FP8), 2),
    (dict(BASE, payload_dtype=FP8), 2),
    (dict(BASE, num_experts=7), 2),
    (dict(BASE, ranks_per_node=3), 4),
    (dict(LL, expert_alignment=2), 2),
    (dict(BASE, recv_mode="capacity", expert_capacity=3, expert_alignment=8,
          max_recv_tokens_per_rank=2 * 16 + 1), 4),
    (dict(BASE, recv_mode="capacity", max_recv_tokens_per_rank=40, rail_capacity=17), 2),
    (dict(BASE, recv_mode="capacity", max_recv_tokens_per_rank=40, rail_capacity=-1), 2),
    (dict(BASE, rail_capacity=4), 2),
]


def _built(fields: dict, world: int) -> config.GroupConfig:
    return config.GroupConfig.build(world, **fields)  # the fields' checks only


@needs_library
@pytest.mark.parametrize("fields, world", AT_BOUND)
def test_both_backends_accept_a_configuration_at_a_bound(fields, world):
    cfg = _built(fields, world)
    cfg.check_rules(world)  # the reference backend's
    cuda_backend._C.check_config(cuda_backend._c_config(cfg), world)  # the cuda backend's


@needs_library
@pytest.mark.parametrize("fields, world", PAST_BOUND)
def test_both_backends_refuse_a_configuration_past_a_bound(fields, world):
    """Refused by the reference's copy of the rules with its message, and by the library (the
    cuda backend's one check) with the library's: never by Python for the cuda backend."""
    cfg = _built(fields, world)
    with pytest.raises(ValueError, match=r"^GroupConfig: "):
        cfg.check_rules(world)
    with pytest.raises(ValueError, match=r"^ncclEpCreateGroup: ") as refused:
        cuda_backend.CudaBackend.check(cfg, world, None)
    assert "GroupConfig" not in str(refused.value)


# (fields, world size): what the cuda backend alone lacks, so the library refuses it and the
# reference runs it (GroupConfig.check_rules leaves it out): its kernels' limits, and LL groups
# that span nodes (designed, not built in the library: docs/internode.md). The refusal's one
# owner is config.cc (check_config, check_ll_config).
CUDA_BACKEND_ONLY = [
    (dict(BASE, dtype=torch.float64), 2),
    (dict(LL, ranks_per_node=1), 2),
    (dict(LL, num_experts=16, ranks_per_node=2), 4),
]


@needs_library
@pytest.mark.parametrize("fields, world", CUDA_BACKEND_ONLY)
def test_the_library_alone_refuses_what_the_cuda_backend_lacks(fields, world):
    cfg = _built(fields, world)
    cfg.check_rules(world)  # the reference runs it
    with pytest.raises(ValueError, match=r"^ncclEpCreateGroup: ") as refused:
        cuda_backend.CudaBackend.check(cfg, world, None)
    if cfg.mode == "ll":
        assert "LL runs on one node" in str(refused.value), refused.value


def test_the_reference_backend_runs_the_python_rules():
    with pytest.raises(ValueError, match=r"^GroupConfig: num_sms must be in \[1, 1024\]"):
        ep.Group(backend="torch", device="cpu", **dict(BASE, num_sms=limits.MAX_NUM_SMS + 1))


@needs_library
def test_expert_block_rows_are_the_librarys():
    """§3's fixed-capacity rows, computed in Python (GroupConfig.static_recv_rows) and in the
    library: the library takes exactly Python's rows in capacity mode."""
    for world, capacity, alignment in [(1, 1, 1), (2, 3, 8), (4, 5, 16), (8, 7, 3), (3, 2, 128)]:
        fields = dict(num_experts=2 * world, hidden=128, max_tokens_per_rank=16, max_topk=2,
                      recv_mode="capacity", expert_capacity=capacity,
                      expert_alignment=alignment)
        cfg = _built(fields, world)
        rows = cfg.static_recv_rows(world)
        assert rows == cfg.max_recv_tokens_per_rank == 2 * cfg.expert_block_rows(world)
        cuda_backend._C.check_config(cuda_backend._c_config(cfg), world)
        for wrong in (rows - 1, rows + 1):
            bad = _built(dict(fields, max_recv_tokens_per_rank=wrong), world)
            with pytest.raises(ValueError, match=rf"fixes every dispatch output at {rows} rows"):
                cuda_backend._C.check_config(cuda_backend._c_config(bad), world)


# -- the LL outputs' fields, and payload dtypes as data -------------------------------------------
@needs_library
def test_the_bindings_take_the_outputs_order_from_outputs_py():
    _C = cuda_backend._C
    cfg = _built(dict(LL, ll_layout="rank_major", payload_dtype=FP8), 2)
    fields = list(zip(outputs.FIELDS, outputs.ll_dispatch_fields(cfg, 2, True)))
    assert _C.LLOutputs(fields).names == outputs.FIELDS
    assert _C.LLOutputs(fields[::-1]).names == outputs.FIELDS[::-1]
    with pytest.raises(ValueError, match=r"no LL dispatch output is named 'y' \(the library's: "
                                         r"x, count, "):
        _C.LLOutputs(fields[:-1] + [("y", None)])
    with pytest.raises(ValueError, match=r"'x' is named twice"):
        _C.LLOutputs([fields[0]] + fields[:-1])
    with pytest.raises(ValueError, match=r"one \(name, \(shape, dtype\) or None\) per LL dispatch "
                                         r"output .*got 5"):
        _C.LLOutputs(fields[:-1])
    binding = _c_code(ROOT / "csrc" / "bindings" / "nccl_ep_py.cc")
    slots = re.findall(r'\{"(\w+)", &ncclEpDispatchOutputs_t::', binding)
    assert sorted(slots) == sorted(outputs.FIELDS), "a field without its slot in the bindings"


def test_a_payload_dtype_is_data():
    """Every payload dtype of config.LL_PAYLOADS goes through the reference's steps from its
    entry alone: the outputs' dtype and scales, the message bytes, the cast."""
    for dtype, payload in config.LL_PAYLOADS.items():
        cfg = _built(dict(LL, payload_dtype=dtype), 2)
        assert cfg.ll_payload() == (dtype, payload)
        x_field, _, scales_field = outputs.ll_dispatch_fields(cfg, 2, False)[:3]
        assert x_field[1] == dtype
        assert scales_field == (x_field[0][:-1] + (cfg.hidden // payload.scale_block,),
                                torch.float32)
        row = cfg.hidden * torch.empty((), dtype=dtype).element_size()
        assert ll_reference.payload_bytes(cfg) == row + 4 * (cfg.hidden // payload.scale_block)
        q, scales = payload.cast(torch.randn(3, cfg.hidden))
        assert q.dtype == dtype and payload.dequant(q, scales).shape == (3, cfg.hidden)
    plain = _built(LL, 2)
    assert plain.ll_payload() == (plain.dtype, None)
    with pytest.raises(ValueError, match=r"payload_dtype must be None \(the token dtype\) or one "
                                         r"of \(torch.float8_e4m3fn,\), got torch.int8"):
        _built(dict(LL, payload_dtype=torch.int8), 2)


@needs_library
def test_the_library_names_every_payload_dtype():
    _C = cuda_backend._C
    for dtype in config.LL_PAYLOADS:
        cfg = _built(dict(LL, payload_dtype=dtype), 2)
        _C.check_config(cuda_backend._c_config(cfg), 2)
        assert cuda_backend._c_config(cfg).payload_dtype != cuda_backend._c_config(
            _built(LL, 2)).payload_dtype
    c = _C.GroupConfig()
    with pytest.raises(ValueError, match=r"payload_dtype Int is not an LL payload"):
        c.payload_dtype = torch.int32


# -- a GroupConfig field reaches the library ------------------------------------------------------
# Each Python field, a configuration where it matters and another value of it.
_HT = config.GroupConfig(num_experts=8, hidden=64, max_tokens_per_rank=6, max_topk=3)
_CAPACITY = config.GroupConfig(num_experts=8, hidden=64, max_tokens_per_rank=6, max_topk=3,
                               recv_mode="capacity", max_recv_tokens_per_rank=40)
_LL = config.GroupConfig(num_experts=8, hidden=128, max_tokens_per_rank=6, max_topk=3, mode="ll")
FIELD_CHANGES = {
    "num_experts": (_HT, 16), "hidden": (_HT, 128), "max_tokens_per_rank": (_HT, 7),
    "max_topk": (_HT, 2), "dtype": (_HT, torch.float16), "recv_mode": (_CAPACITY, "exact"),
    "max_recv_tokens_per_rank": (_CAPACITY, 48), "capacity_overflow": (_CAPACITY, "drop"),
    "expert_alignment": (_HT, 16), "num_sms": (_HT, 8), "timeout_s": (_HT, 2.5),
    "staging_chunk_tokens": (_HT, 64), "staging_depth": (_HT, 4), "ranks_per_node": (_HT, 4),
    "expert_capacity": (_HT, 5), "rail_capacity": (_CAPACITY, 3), "mode": (_LL, "ht"),
    "ll_layout": (_LL, "rank_major"), "payload_dtype": (_LL, torch.float8_e4m3fn),
}


def _c_fields(group_config) -> dict:
    c = cuda_backend._c_config(group_config)
    return {name: getattr(c, name) for name in dir(c) if not name.startswith("_")}


# The fields of ncclEpGroupConfig_t each rank may set for itself: the struct's own size and the
# allocator (its callbacks and context are this process's).
RANK_LOCAL_FIELDS = {"size", "alloc_fn", "free_fn", "alloc_ctx"}


def _struct_fields(text: str, name: str) -> list:
    end = text.index("} " + name + ";")
    body = text[text.rindex("typedef struct {", 0, end):end]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return re.findall(r"(\w+)(?:\[[^\]]*\])?\s*;", body)


def test_every_group_config_field_is_agreed_on_at_creation():
    # A field that changes what ranks exchange must be equal on every rank: group creation
    # all-gathers a record of them and refuses a mismatch naming the field (config.cc,
    # ConfigRecord and kConfigFields, whose lengths a static_assert ties). A new
    # ncclEpGroupConfig_t field goes there, or into RANK_LOCAL_FIELDS with its reason.
    header = (ROOT / "csrc" / "include" / "nccl_ep.h").read_text()
    fields = _struct_fields(header, "ncclEpGroupConfig_t")
    assert {"num_experts", "payload_dtype", "alloc_fn"} <= set(fields)
    source = (ROOT / "csrc" / "runtime" / "config.cc").read_text()
    names = re.search(r"kConfigFields\[\]\s*=\s*\{(.*?)\};", source, re.S).group(1)
    agreed = {n.split(" (")[0] for n in re.findall(r'"([^"]+)"', names)}
    missing = [f for f in fields if f not in agreed and f not in RANK_LOCAL_FIELDS]
    assert not missing, f"ncclEpGroupConfig_t fields not agreed on at creation: {missing}"


@needs_library
def test_every_group_config_field_reaches_the_library():
    # A new GroupConfig field needs an entry here, and cuda_backend._c_config must pass it on
    # (docs/design.md §1, "a GroupConfig field"); every field of the C struct is set from one.
    import dataclasses

    assert set(FIELD_CHANGES) == {f.name for f in dataclasses.fields(config.GroupConfig)}
    set_by = set()
    for name, (base, value) in FIELD_CHANGES.items():
        before, after = _c_fields(base), _c_fields(dataclasses.replace(base, **{name: value}))
        changed = {field for field in before if before[field] != after[field]}
        assert changed, f"GroupConfig.{name} does not reach the library's configuration"
        set_by |= changed
    assert set_by == set(_c_fields(_HT)), "C fields set by no GroupConfig field"
