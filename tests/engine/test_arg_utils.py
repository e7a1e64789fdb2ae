"""The shared engine / sampling flags: one flag per EngineArgs field, values checked when parsed."""

import argparse
import dataclasses
import math

import numpy as np
import pytest

from tqattn.engine import arg_utils
from tqattn.engine.llm_engine import EngineArgs
from tqattn.engine.sampling import SamplingParams


def _parser():
    p = argparse.ArgumentParser()
    arg_utils.add_engine_args(p)
    arg_utils.add_sampling_args(p)
    return p


def test_every_engine_arg_has_a_flag_with_the_dataclass_default():
    args = _parser().parse_args([])
    kwargs = arg_utils.engine_kwargs_from_args(args)
    assert set(kwargs) == {f.name for f in dataclasses.fields(EngineArgs)}
    assert EngineArgs(**kwargs) == EngineArgs()


def test_flags_reach_engine_args_and_sampling_params():
    args = _parser().parse_args([
        "--model", "llama-tiny", "--load-format", "dummy", "--kv-cache-dtype", "tq_k4v3",
        "--kv-cache-dtype-skip-layers", "0,sliding_window", "--kv-cache-boundary-layers", "1",
        "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
        "--block-size", "32", "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "1.5M",
        "--device", "cpu", "--enforce-eager", "--seed", "7",
        "--max-tokens", "9", "--min-tokens", "2", "--temperature", "0.5", "--top-p", "0.9",
        "--top-k", "5", "--stop", "a", "--stop", "\n\n", "--stop-token-ids", "3,4", "--ignore-eos"])
    kw = arg_utils.engine_kwargs_from_args(args)
    assert kw["kv_cache_dtype_skip_layers"] == [0, "sliding_window"]
    assert kw["kv_cache_key_centering"] is None and kw["kv_cache_auto_skip_budget"] == 0.2
    assert (kw["max_model_len"], kw["block_size"], kw["enable_prefix_caching"]) == (64, 32, False)
    assert kw["kv_cache_memory_bytes"] == 1536 * 1024 and kw["enforce_eager"] and kw["seed"] == 7
    sp = arg_utils.sampling_params_from_args(args)
    assert sp == SamplingParams(temperature=0.5, top_p=0.9, top_k=5, max_tokens=9, min_tokens=2,
                                stop=["a", "\n\n"], stop_token_ids=[3, 4], ignore_eos=True, seed=7)


def test_routing_flags():
    kw = arg_utils.engine_kwargs_from_args(_parser().parse_args([]))
    assert kw["kv_cache_dtype_skip_layers"] == ["auto"]   # the same default as the API's
    kw = arg_utils.engine_kwargs_from_args(_parser().parse_args([
        "--kv-cache-dtype-skip-layers", "none", "--no-kv-cache-key-centering",
        "--kv-cache-auto-skip-budget", "0.5"]))
    assert kw["kv_cache_dtype_skip_layers"] == [] and kw["kv_cache_key_centering"] is False
    assert kw["kv_cache_auto_skip_budget"] == 0.5
    kw = arg_utils.engine_kwargs_from_args(_parser().parse_args([
        "--kv-cache-dtype-skip-layers", "auto,3", "--kv-cache-key-centering"]))
    assert kw["kv_cache_dtype_skip_layers"] == ["auto", 3] and kw["kv_cache_key_centering"]
    for bad in (-1, math.inf, math.nan, "0.2"):
        with pytest.raises(ValueError, match="kv_cache_auto_skip_budget must be a finite number >= 0"):
            EngineArgs(kv_cache_auto_skip_budget=bad)


def test_routing_arguments_checked_before_the_model_loads():
    # None means the default, as for every other routing setting
    assert EngineArgs(kv_cache_dtype_skip_layers=None).kv_cache_dtype_skip_layers == ["auto"]
    assert EngineArgs(kv_cache_dtype_skip_layers=np.int64(3)).kv_cache_dtype_skip_layers == [3]
    assert EngineArgs(kv_cache_boundary_layers=np.int64(1)).kv_cache_boundary_layers == 1
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"kv_cache_boundary_layers must be an int >= 0, got {bad!r}"):
            EngineArgs(kv_cache_boundary_layers=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype_skip_layers must be a list"):
        EngineArgs(kv_cache_dtype_skip_layers=1.5)
    with pytest.raises(ValueError, match=r"entry -1 is out of range; allowed"):
        EngineArgs(kv_cache_dtype_skip_layers=[-1])
    with pytest.raises(ValueError, match=r"entry 'first' is not understood"):
        EngineArgs(kv_cache_dtype_skip_layers=["auto", "first"])
    with pytest.raises(ValueError, match="kv_cache_key_centering must be True, False or None"):
        EngineArgs(kv_cache_key_centering="yes")


def test_command_line_sampling_defaults_are_greedy_64_tokens():
    sp = arg_utils.sampling_params_from_args(_parser().parse_args([]))
    assert (sp.temperature, sp.max_tokens, sp.seed) == (0.0, arg_utils.CLI_MAX_TOKENS, None)
    assert arg_utils.CLI_MAX_TOKENS == 64
    assert (SamplingParams().temperature, SamplingParams().max_tokens) == (1.0, 16)  # the API's


@pytest.mark.parametrize("text,value", [("268435456", 1 << 28), ("256M", 1 << 28), ("2G", 2 << 30),
                                        ("2GiB", 2 << 30), ("64k", 65536), ("1.5M", 1572864)])
def test_byte_counts(text, value):
    assert arg_utils.num_bytes(text) == value


@pytest.mark.parametrize("flag,value", [
    ("--kv-cache-memory-bytes", "0"), ("--kv-cache-memory-bytes", "1.5"), ("--kv-cache-memory-bytes", "M"),
    ("--max-model-len", "0"), ("--kv-cache-boundary-layers", "-1"), ("--gpu-memory-utilization", "0"),
    ("--device", "cuda:x"), ("--device", "mps"), ("--kv-cache-dtype", "turboquant_2bit"),
    ("--max-tokens", "1.5"), ("--min-tokens", "-1"), ("--temperature", "nan"), ("--top-p", "0"),
    ("--top-k", "-2"), ("--stop-token-ids", "1,a"), ("--kv-cache-auto-skip-budget", "-0.1"),
    ("--temperature", "inf"), ("--seed", str(2**64)), ("--seed", str(-2**63 - 1)), ("--seed", "1.5"),
])
def test_bad_values_fail_at_parse_time_naming_the_value(flag, value, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args([flag, value])
    err = capsys.readouterr().err
    assert flag in err and repr(value) in err


def test_engine_args_check_the_device():
    with pytest.raises(ValueError, match="device='gpu' is not supported"):
        EngineArgs(device="gpu")
    EngineArgs(device="cpu")
