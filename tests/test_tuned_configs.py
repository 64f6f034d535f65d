"""Shipped Triton tuning choices (nanoinfer.backends.cuda.tuned_configs): the GEMV autotuners' prune hook takes
the shipped config for a known key and leaves every config to tuning otherwise; tables round-trip
from an Autotuner's cache through the file; a malformed file is an error naming it. CPU only:
the hook is called as Triton's Autotuner calls it, with stand-in configs and tensors."""

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from nanoinfer.backends.cuda import tuned_configs
from nanoinfer.errors import RequestError
from nanoinfer.backends.cuda.tuned_configs import (
    ConfigChoice,
    KernelTable,
    ShippedChoice,
    TunedConfigsError,
    autotune_key,
    choices_from_cache,
    device_file_stem,
    merge,
    read_table,
    table_path,
    write_table,
)

H100 = "NVIDIA H100 80GB HBM3"


@dataclass(eq=False)  # (identity, as triton.Config: the hook must hand back the kernel's own objects)
class FakeConfig:
    kwargs: dict
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class FakeTensor:
    dtype: torch.dtype
    device: torch.device = field(default_factory=lambda: torch.device("cuda", 0))


CONFIGS = [FakeConfig({"BLOCK_N": n, "BLOCK_K": k}, w, s)
           for n, k, w, s in ((4, 1024, 4, 3), (8, 512, 4, 3), (16, 512, 8, 3), (2, 2048, 4, 4))]
KEY_NAMES = ("N", "K", "W_BYTES", "ROWS", "NORM", "SILU")


def gemv_call(n=3072, k=1024, norm=True, dtype=torch.bfloat16, device=None):
    """(named_args, kwargs) as the Autotuner hands them to the hook for a fused_gemv launch of
    _gemv_kernel: positional arguments by name; constexprs, grid and warmup as keyword arguments."""
    t = FakeTensor(dtype) if device is None else FakeTensor(dtype, device)
    w = FakeTensor(torch.int8 if dtype is None else dtype, t.device)
    named = dict(x_ptr=t, w_ptr=w, scale_ptr=w, out_ptr=t, N=n, K=k, stride_wn=k, stride_xm=k, stride_om=n,
                 W_BYTES=2, norm_ptr=t, res_ptr=t, eps=1e-6)
    kwargs = dict(grid=lambda meta: (1,), warmup=False, HAS_SCALE=False, INT8=False, ROWS=1, NORM=norm,
                  SILU=False, RESIDUAL=False)
    return named, kwargs


def write_h100(directory: Path, choices: dict) -> Path:
    path = table_path(H100, directory)
    write_table(path, H100, {"_gemv_kernel": KernelTable(KEY_NAMES, choices)}, "3.6.0")
    return path


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("NANOINFER_AUTOTUNE", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    tuned_configs.load_table.cache_clear()
    yield
    tuned_configs.load_table.cache_clear()


def test_device_file_stem():
    assert device_file_stem(H100) == "nvidia_h100_80gb_hbm3"
    assert device_file_stem("NVIDIA H200") == "nvidia_h200"
    assert device_file_stem("  AMD Instinct MI300X / (gfx942) ") == "amd_instinct_mi300x_gfx942"
    with pytest.raises(ValueError, match="'--'"):
        device_file_stem("--")


def test_autotune_key_is_the_autotuners():
    # triton/runtime/autotuner.py's run(): the key arguments' values, then every dtype in argument order
    named, kwargs = gemv_call()
    assert autotune_key(KEY_NAMES, named, kwargs) == (3072, 1024, 2, 1, True, False) + ("torch.bfloat16",) * 6


def test_shipped_config_for_a_known_key(tmp_path):
    named, kwargs = gemv_call()
    write_h100(tmp_path, {autotune_key(KEY_NAMES, named, kwargs): ConfigChoice.of(CONFIGS[2])})
    assert ShippedChoice("_gemv_kernel", tmp_path)(CONFIGS, named, **kwargs) == [CONFIGS[2]]
    assert ShippedChoice("_gemv_kernel", tmp_path)(CONFIGS, named, **kwargs)[0] is CONFIGS[2]


@pytest.mark.parametrize("case", ["other shape", "other constexpr", "other dtype", "other kernel", "other device",
                                  "cpu tensors", "full tuning", "config gone"])
def test_all_configs_otherwise(tmp_path, monkeypatch, case):
    named, kwargs = gemv_call()
    shipped = ConfigChoice.of(CONFIGS[2])
    if case == "config gone":
        shipped = ConfigChoice((("BLOCK_K", 1024), ("BLOCK_N", 128)), 4, 3)
    write_h100(tmp_path, {autotune_key(KEY_NAMES, named, kwargs): shipped})
    kernel = "_gemv_kernel"
    if case == "other shape":
        named, kwargs = gemv_call(n=4096)
    elif case == "other constexpr":
        named, kwargs = gemv_call(norm=False)
    elif case == "other dtype":
        named, kwargs = gemv_call(dtype=torch.float16)
    elif case == "other kernel":
        kernel = "_rows_kernel"
    elif case == "other device":
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    elif case == "cpu tensors":
        named, kwargs = gemv_call(device=torch.device("cpu"))
    elif case == "full tuning":
        monkeypatch.setenv("NANOINFER_AUTOTUNE", "full")
    assert ShippedChoice(kernel, tmp_path)(CONFIGS, named, **kwargs) == CONFIGS


def test_a_key_missing_from_the_table_takes_a_choice_of_the_same_like_values(tmp_path):
    # (as the int4 GEMV: AWQ's fp32 scales take the choice swept with fp16 ones for the same shape)
    named, kwargs = gemv_call(norm=False)
    write_h100(tmp_path, {autotune_key(KEY_NAMES, named, kwargs): ConfigChoice.of(CONFIGS[2])})
    hook = ShippedChoice("_gemv_kernel", tmp_path, like=("N", "K"))
    for n, norm, dtype, want in ((3072, True, torch.bfloat16, [CONFIGS[2]]), (3072, False, torch.float16, [CONFIGS[2]]),
                                 (4096, False, torch.bfloat16, CONFIGS)):
        named, kwargs = gemv_call(n=n, norm=norm, dtype=dtype)
        assert hook(CONFIGS, named, **kwargs) == want, (n, norm, dtype)
    # without `like`, only the exact key
    named, kwargs = gemv_call(norm=True)
    assert ShippedChoice("_gemv_kernel", tmp_path)(CONFIGS, named, **kwargs) == CONFIGS


def test_no_table_directory_tunes_everything(tmp_path):
    named, kwargs = gemv_call()
    assert ShippedChoice("_gemv_kernel", tmp_path / "missing")(CONFIGS, named, **kwargs) == CONFIGS


def test_a_bad_mode_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOINFER_AUTOTUNE", "fast")
    named, kwargs = gemv_call()
    with pytest.raises(RequestError, match="NANOINFER_AUTOTUNE='fast'.*shipped, full"):
        ShippedChoice("_gemv_kernel", tmp_path)(CONFIGS, named, **kwargs)


GOOD_CHOICE = '{"key": [1, 2], "kwargs": {"BLOCK_N": 4}, "num_warps": 4, "num_stages": 3}'


@pytest.mark.parametrize("text, words", [
    ("{not json", ["JSON", "expected"]),
    ('{"device": "NVIDIA H100 80GB HBM3"}', ["kernels"]),
    (('{"device": "NVIDIA H100 80GB HBM3", "kernels": {"_gemv_kernel": {"key": ["N"], "choices": '
      '[{"key": [1], "kwargs": {"BLOCK_N": 4}, "num_warps": "four", "num_stages": 3}]}}}'), ["num_warps", "int"]),
    (('{"device": "NVIDIA H100 80GB HBM3", "kernels": {"_gemv_kernel": {"key": ["N"], "choices": '
      '[{"key": [1], "kwargs": {"BLOCK_N": 4}, "num_warps": 4}]}}}'), ["num_stages"]),
    ('{"device": "NVIDIA H100 80GB HBM3", "kernels": {}, "extra": 1}', ["extra"]),
    ('{"device": "NVIDIA H200", "kernels": {}}', ["'NVIDIA H200'", "nvidia_h200.json"]),
    ('{"device": "NVIDIA H100 80GB HBM3", "kernels": {"k": {"key": ["N", "K"], "choices": ['
     + GOOD_CHOICE + ", " + GOOD_CHOICE + "]}}}", ["two choices", "[1, 2]"]),
])
def test_a_malformed_file_is_an_error_naming_it(tmp_path, text, words):
    path = table_path(H100, tmp_path)
    path.write_text(text)
    named, kwargs = gemv_call()
    with pytest.raises(TunedConfigsError) as info:
        ShippedChoice("_gemv_kernel", tmp_path)(CONFIGS, named, **kwargs)
    for word in [str(path)] + words:
        assert word in str(info.value)


def test_dump_then_load_round_trip(tmp_path):
    # an Autotuner's .cache after a full tuning: key tuple -> the winning Config
    named_1, kwargs_1 = gemv_call(n=3072)
    named_2, kwargs_2 = gemv_call(n=1024, norm=False)
    key_1, key_2 = autotune_key(KEY_NAMES, named_1, kwargs_1), autotune_key(KEY_NAMES, named_2, kwargs_2)
    cache = {key_1: CONFIGS[3], key_2: CONFIGS[0]}
    path = table_path(H100, tmp_path)
    write_table(path, H100, {"_gemv_kernel": KernelTable(KEY_NAMES, choices_from_cache(cache))}, "3.6.0")
    device, table = read_table(path)
    assert device == H100
    assert table == {"_gemv_kernel": KernelTable(KEY_NAMES, {key_1: ConfigChoice.of(CONFIGS[3]),
                                                              key_2: ConfigChoice.of(CONFIGS[0])})}
    hook = ShippedChoice("_gemv_kernel", tmp_path)
    assert hook(CONFIGS, named_1, **kwargs_1)[0] is CONFIGS[3]
    assert hook(CONFIGS, named_2, **kwargs_2)[0] is CONFIGS[0]

    # a second dump (another shape, one key re-tuned) merges over the first
    named_3, kwargs_3 = gemv_call(n=8192)
    key_3 = autotune_key(KEY_NAMES, named_3, kwargs_3)
    again = {"_gemv_kernel": KernelTable(KEY_NAMES, choices_from_cache({key_2: CONFIGS[1], key_3: CONFIGS[2]}))}
    write_table(path, H100, merge(table, again))
    assert read_table(path)[1]["_gemv_kernel"].choices == {
        key_1: ConfigChoice.of(CONFIGS[3]), key_2: ConfigChoice.of(CONFIGS[1]), key_3: ConfigChoice.of(CONFIGS[2])}
    # (each process reads a table once: this one still has the first file's choices)
    assert hook(CONFIGS, named_2, **kwargs_2)[0] is CONFIGS[0]


def test_merge_drops_choices_tuned_under_other_key_names():
    old = {"a": KernelTable(("N",), {(1,): ConfigChoice((), 4, 3)}), "b": KernelTable(("N",), {})}
    new = {"a": KernelTable(("N", "K"), {(1, 2): ConfigChoice((), 8, 3)})}
    assert merge(old, new) == {"a": new["a"], "b": old["b"]}


def test_an_unwritable_key_value_is_an_error(tmp_path):
    table = {"k": KernelTable(("N",), {(object(),): ConfigChoice((), 4, 3)})}
    with pytest.raises(TunedConfigsError, match="not an int, bool, float or str"):
        write_table(table_path(H100, tmp_path), H100, table)


def test_every_gemv_autotuner_has_the_hook_under_its_own_name():
    # (read as text: triton does not import on a CPU-only machine)
    source = "\n".join((Path(tuned_configs.__file__).parent / f).read_text() for f in ("gemv.py", "int4_gemv.py"))
    blocks = re.findall(r"@triton\.autotune\((.*?)\n\)\n@triton\.jit(?:\([^)]*\))?\ndef (\w+)\(", source, re.DOTALL)
    assert len(blocks) == source.count("@triton.autotune(") == 4
    for decorator, name in blocks:
        assert re.search(rf'prune_configs_by={{"early_config_prune": ShippedChoice\("{name}"[,)]', decorator), name


def test_the_shipped_int4_choices_are_filed_under_the_keys_its_launches_make():
    """Triton's tuner keys a call by its key arguments and every tensor argument's dtype: when the
    one-row int4 kernel gained a tensor argument (the residual), every shipped key missed until the
    table gained its dtype (a review's finding). Here the key of an 8B down projection's launch,
    from the arguments `nanoinfer.backends.cuda.int4_gemv` passes, against the H100 table. (Needs Triton, not a GPU.)"""
    pytest.importorskip("triton")
    from nanoinfer.backends.cuda import int4_gemv

    n, k, group = 4096, 14336, 128
    scale = torch.empty(n, k // group, dtype=torch.float16)
    args = int4_gemv.int4_gemv_args(torch.empty(1, k, dtype=torch.bfloat16), torch.empty(n, k // 8, dtype=torch.int32),
                               scale, scale, torch.empty(1, n, dtype=torch.bfloat16))
    tuner = int4_gemv._int4_gemv_kernel
    key = autotune_key(tuner.keys, dict(zip(tuner.arg_names, args)), {"GROUP": group, "HALF": True})
    _, table = read_table(table_path(H100))
    assert key in table["_int4_gemv_kernel"].choices
