"""What the report's sections share: tables, figures, run lookups.

A run is one entry of the results files (a dict with `date` and
`commit`); `latest` picks, for each ratio, the newest run that
measured it.
"""

__all__ = (
    "MODELS",
    "COMPARISONS",
    "REFERENCE",
    "number",
    "numbers",
    "table",
    "step_runs",
    "latest",
    "when",
    "held",
    "by_id",
)

MODELS = ("mlp", "transformer", "transformer_small")
# (ratio name in the results, label, native counterpart)
COMPARISONS = (
    ("kd_dp_over_ddp", "kd-DP ÷ DDP", "DDP"),
    ("kd_mp_over_tp", "kd-MP ÷ TP", "TP"),
    ("kd_fsdp_over_fsdp2", "kd-FSDP ÷ FSDP2", "FSDP2"),
    ("kd_mp_over_kd_mp_dtensor", "kd-MP local ÷ kd-MP as DTensors", None),
    ("kd_mp_jit_over_kd_mp", "kd-MP jit_compile ÷ eager", None),
    ("keras_single_jit_over_keras_single", "Keras jit_compile ÷ eager", None),
)
REFERENCE = "keras_over_torch_single"


def number(value, digits=2):
    """A figure to `digits` places; `-` for None."""
    return "-" if value is None else f"{value:.{digits}f}"


def numbers(values, digits=2, sep=" "):
    """Figures joined by `sep`."""
    return sep.join(number(v, digits) for v in values)


def _row(*cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(head, rows):
    """A Markdown table as a list of lines."""
    lines = [_row(*head), _row(*["---"] * len(head))]
    lines += [_row(*r) for r in rows]
    return lines


def step_runs(data):
    """Every paired run as (date, run), the results files first."""
    history = data["results-history.json"]
    meta = history["files"]["results-targets.json"]
    targets = data["results-targets.json"]
    runs = [
        dict(
            meta,
            id="results-targets.json",
            rounds=targets["rounds"],
            targets=targets["targets"],
        )
    ]
    runs += history["step"]
    return sorted(runs, key=lambda run: run["date"])  # stable: list order


def latest(data):
    """{(model, ratio): (record, run)}: the newest run of each ratio."""
    found = {}
    for run in step_runs(data):
        for model, ratios in run["targets"].items():
            for name, record in ratios.items():
                if isinstance(record, dict):
                    found[model, name] = (record, run)
    return found


def when(run):
    """A run's date and commit."""
    return f"{run['date']}, {run['commit']}"


def held(record):
    """How a ratio's target held: by ratio, in ms, or `-`."""
    ratio = record.get("holds_in_rounds")
    ms = record.get("extra_holds")
    parts = []
    if ratio:
        parts.append(f"{ratio} by ratio")
    if ms:
        parts.append(f"{ms} in ms")
    return ", ".join(parts) or "-"


def by_id(data, area):
    """An area's runs in `results-history.json`, by id."""
    return {run["id"]: run for run in data["results-history.json"][area]}
