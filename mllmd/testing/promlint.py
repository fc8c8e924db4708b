"""A pure-Python stand-in for `promtool check metrics`, plus the checks promtool does not make.

promtool (Prometheus's client_golang promlint) is absent on most CI machines; these rules follow
it, so that the lint runs everywhere: snake_case names, HELP on every family, counters named
`_total` and nothing else so, no type name or abbreviated / scaled unit in a name, histogram
suffixes on histograms only. Beyond promtool: the text must parse with prometheus-client's parser,
no series may appear twice, histogram buckets must rise to `+Inf`, and no `_created` series may
come out as gauges of their own (the 0.0.4 text format has no place for them: each counter and
histogram series would be doubled by a gauge that no query wants).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["lint", "label_values"]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_TYPE_WORDS = ("counter", "gauge", "histogram", "summary", "untyped")
# promlint's unit rules: abbreviations, and SI prefixes on a base unit (use the base unit).
_ABBREVIATIONS = {
    "s",
    "ms",
    "us",
    "ns",
    "sec",
    "secs",
    "b",
    "kb",
    "mb",
    "gb",
    "tb",
    "kib",
    "mib",
    "gib",
    "m",
    "h",
    "d",
    "pct",
}
_PREFIXES = (
    "pico",
    "nano",
    "micro",
    "milli",
    "centi",
    "deci",
    "kilo",
    "kibi",
    "mega",
    "mebi",
    "giga",
    "gibi",
    "tera",
    "tebi",
)
_BASE_UNITS = ("seconds", "bytes", "hertz", "watts", "volts", "amperes", "joules", "meters", "grams")
_OTHER_UNITS = {
    "minutes": "seconds",
    "hours": "seconds",
    "days": "seconds",
    "percent": "ratio",
    "fahrenheit": "celsius",
    "kelvin": "celsius",
}


def _name_problems(name: str, kind: str) -> list[str]:
    out = []
    if not _NAME.match(name):
        out.append(f"{name}: metric names are snake_case ([a-z][a-z0-9_]*)")
    words = name.split("_")
    for word in _TYPE_WORDS:
        if word in words[1:]:
            out.append(f"{name}: metric name should not include the type '{word}'")
    for word in words[1:]:
        if word in _ABBREVIATIONS:
            out.append(f"{name}: '{word}' is an abbreviated unit; spell out the base unit")
        if word in _OTHER_UNITS:
            out.append(f"{name}: use base unit '{_OTHER_UNITS[word]}' instead of '{word}'")
        for prefix in _PREFIXES:
            for unit in _BASE_UNITS:
                if word == prefix + unit:
                    out.append(f"{name}: use base unit '{unit}' instead of '{word}'")
    if kind != "counter" and name.endswith("_total"):
        out.append(f"{name}: non-counter metrics should not have the '_total' suffix")
    if kind not in ("histogram", "summary") and name.endswith(("_count", "_sum", "_bucket")):
        out.append(f"{name}: non-histogram metrics should not have a '_count', '_sum' or '_bucket' suffix")
    if name.endswith("_created"):
        out.append(f"{name}: a '_created' series exported as a metric of its own")
    return out


def lint(text: str) -> list[str]:
    """Every problem found in a Prometheus text exposition (empty: clean)."""
    problems: list[str] = []
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises ValueError and friends on a malformed line
        return [f"does not parse: {e}"]
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    typed = {m.group(1) for m in re.finditer(r"^# TYPE (\S+) ", text, re.M)}
    for fam in families:
        exposed = fam.name + "_total" if fam.type == "counter" and f"{fam.name}_total" in typed else fam.name
        if fam.type == "counter" and exposed == fam.name:
            problems.append(f"{fam.name}: counter metrics should have the '_total' suffix")
        problems += _name_problems(exposed, fam.type)
        if not fam.documentation:
            problems.append(f"{exposed}: no help text")
        buckets: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            if key in seen:
                problems.append(f"duplicate series {s.name}{dict(key[1])}")
            seen.add(key)
            if fam.type == "counter" and not s.name.endswith(("_total", "_created")):
                problems.append(f"{s.name}: a counter sample without the '_total' suffix")
            if "le" in s.labels and fam.type != "histogram":
                problems.append(f"{s.name}: label 'le' outside a histogram")
            if s.name.endswith("_bucket") and fam.type == "histogram":
                rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                buckets.setdefault(rest, []).append((float(s.labels["le"]), s.value))
        for rest, points in buckets.items():
            if points[-1][0] != float("inf"):
                problems.append(f"{fam.name}{dict(rest)}: histogram without a '+Inf' bucket")
            if [le for le, _ in points] != sorted(le for le, _ in points):
                problems.append(f"{fam.name}{dict(rest)}: bucket bounds out of order")
            if [v for _, v in points] != sorted(v for _, v in points):
                problems.append(f"{fam.name}{dict(rest)}: bucket counts decrease")
    return problems


def label_values(text: str, labels: Iterable[str]) -> Mapping[str, set[str]]:
    """label -> every value it takes in `text` (to check that a client cannot make them grow)."""
    wanted = set(labels)
    out: dict[str, set[str]] = {name: set() for name in wanted}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            for k, v in s.labels.items():
                if k in wanted:
                    out[k].add(v)
    return out
