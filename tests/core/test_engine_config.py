"""EngineConfig validation names the offending key."""

from __future__ import annotations

import pytest

from mllmd.config import ConfigError, EngineConfig


def test_defaults_are_valid() -> None:
    cfg = EngineConfig(model_path="/m")
    assert cfg.max_running_requests > 0 and cfg.attention_backend == "auto"


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"max_running_requests": 0}, "scheduler.max_running_requests"),
        ({"max_running_requests": "8"}, "scheduler.max_running_requests"),
        ({"max_running_requests": True}, "scheduler.max_running_requests"),
        ({"chunked_prefill_size": -1}, "scheduler.chunked_prefill_size"),
        ({"dtype": "float64"}, "model.dtype"),
        ({"attention_backend": "cudnn"}, "runtime.attention_backend"),
        ({"mem_fraction_static": 1.5}, "runtime.mem_fraction_static"),
        ({"context_length": 1}, "model.context_length"),
        ({"disable_radix_cache": "yes"}, "cache.disable_radix_cache"),
    ],
)
def test_bad_values_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_kwargs("/m", **kwargs)
    assert err.value.key == key and key in str(err.value)


def test_unknown_option_is_named() -> None:
    with pytest.raises(ConfigError, match="max_runing_requests"):
        EngineConfig.from_kwargs("/m", max_runing_requests=4)


def test_config_is_frozen() -> None:
    cfg = EngineConfig(model_path="/m")
    with pytest.raises(AttributeError):
        cfg.dtype = "float16"  # type: ignore[misc]
    assert cfg.replace(dtype="float16").dtype == "float16"
