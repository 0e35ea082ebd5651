from __future__ import annotations

import inspect
import math

import pytest

from graddebug import ConfigError, Thresholds, Watcher
from graddebug.adapter.options import WATCH_OPTIONS


def test_defaults_are_the_documented_anchor_values() -> None:
    t = Thresholds()
    assert (t.vanishing_ratio, t.vanishing_first, t.vanishing_floor) == (1e-3, 1e-4, 1e-7)
    assert (t.exploding_norm, t.exploding_ratio) == (1e4, 70.0)
    assert t.dead_fraction == 0.7


@pytest.mark.parametrize("name", Thresholds.names())
@pytest.mark.parametrize("bad", [-1.0, 0, math.nan, math.inf])
def test_non_positive_or_non_finite_threshold_is_a_typed_error(name: str, bad: float) -> None:
    with pytest.raises(ConfigError, match=name):
        Thresholds(**{name: bad})


def test_error_is_also_a_value_error() -> None:
    with pytest.raises(ValueError):
        Thresholds(exploding_norm=-5)


def test_dead_fraction_above_one_is_rejected() -> None:
    with pytest.raises(ConfigError, match="dead_fraction"):
        Thresholds(dead_fraction=1.5)


def test_source_share_above_one_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"source_share=1.5 .* \(0, 1\]; the default is 0.5"):
        Thresholds(source_share=1.5)
    assert Thresholds(source_share=1).source_share == 1


def test_unknown_threshold_name_suggests_the_close_one() -> None:
    with pytest.raises(ConfigError, match="exploding_norm"):
        Thresholds().replace(exploding_nrm=3.0)


def test_coerce_accepts_mapping_and_rejects_other_types() -> None:
    assert Thresholds.coerce({"exploding_ratio": 10}).exploding_ratio == 10
    assert Thresholds.coerce(None) == Thresholds()
    with pytest.raises(ConfigError):
        Thresholds.coerce(3.0)  # type: ignore[arg-type]


def test_as_dict_round_trips() -> None:
    t = Thresholds(growth_factor=50.0)
    assert Thresholds(**t.as_dict()) == t


def test_watch_options_are_the_keyword_parameters_of_the_watcher_in_order() -> None:
    parameters = inspect.signature(Watcher.__init__).parameters.values()
    keywords = tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)
    assert keywords == WATCH_OPTIONS
    assert [p.name for p in parameters if p.kind is not inspect.Parameter.KEYWORD_ONLY] == [
        "self", "model"]


def test_watch_has_the_watchers_signature() -> None:
    import graddebug

    assert list(inspect.signature(graddebug.watch).parameters) == ["model", *WATCH_OPTIONS]


def test_watch_options_defaults_are_the_watchers_after_checking() -> None:
    from graddebug.adapter import WatchOptions

    with Watcher() as dbg:
        options = dbg._options
    fresh = WatchOptions()
    for name in WATCH_OPTIONS:
        assert getattr(options, name) == getattr(fresh, name), name
    assert options.thresholds == Thresholds()


def test_an_optimizer_with_no_model_and_no_params_is_a_typed_error() -> None:
    class Opt:
        pass

    with pytest.raises(ConfigError, match=r"optimizer=Opt was given with no model and no params="):
        Watcher(optimizer=Opt())
