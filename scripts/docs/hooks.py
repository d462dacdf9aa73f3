"""MkDocs hooks: the reference pages, generated from the code at every build.

``mkdocs build`` imports this file (``hooks:`` in mkdocs.yml) and adds three pages that
exist in no file, so they cannot drift from the code they describe:

- ``reference/cli.md``: every command of the typer app, walked as the click tree it
  builds (arguments, options, defaults, help);
- ``reference/configuration.md``: the settings dataclasses behind ``--config`` YAML files,
  their fields, types and defaults, and the comment or docstring that explains each;
- ``reference/metrics.md``: every metric the router's Prometheus registry exports;
- ``reference/policies.md``: every routing policy of the registry, its branches and its
  parameters (default, bounds, where the value comes from).

Run it directly to print one page: ``python scripts/docs/hooks.py cli``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from rich.text import Text

CLI_PAGE = "reference/cli.md"
POLICIES_PAGE = "reference/policies.md"
CONFIG_PAGE = "reference/configuration.md"
METRICS_PAGE = "reference/metrics.md"


def cell(text: object) -> str:
    """``text`` fit for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def plain(help_text: str | None) -> str:
    """Help as the terminal shows it, without rich markup or its escapes."""
    return Text.from_markup(help_text or "").plain


# ---------------------------------------------------------------------------- the CLI


# typer builds its commands on a click of its own: parameters and commands are read by
# their attributes here, not by click's classes.


def _is_option(param: Any) -> bool:
    return param.param_type_name == "option"


def _default(param: Any) -> str:
    default = param.default
    if callable(default) or default is None or default == () or not param.show_default:
        return ""
    if _is_option(param) and param.is_flag and param.secondary_opts:
        return f"`{param.opts[0] if default else param.secondary_opts[0]}`"
    return f"`{default}`"


def _name(param: Any) -> str:
    if _is_option(param):
        names = [*param.opts, *param.secondary_opts]
        return ", ".join(f"`{n}`" for n in names)
    return f"`{param.name.upper()}`"


def _commands(group: Any, path: str) -> Iterator[tuple[str, Any]]:
    import typer

    # Asked through the group, which imports each command's module when it is asked for.
    ctx = typer.Context(group)
    for name in sorted(group.list_commands(ctx)):
        command = group.get_command(ctx, name)
        if command.hidden:
            continue
        full = f"{path} {name}"
        if hasattr(command, "commands"):
            yield from _commands(command, full)
        else:
            yield full, command


def cli_page() -> str:
    import typer
    import typer.main

    from smetric.cli import app

    root = typer.main.get_command(app)
    out = [
        "# Command line",
        "",
        "Every `smetric` command, its arguments and options, generated from the code at",
        "each build of this site (the same text `smetric COMMAND --help` prints).",
        "",
        plain(root.help),
        "",
        "A command ends with exit code 0 when done, 2 on bad input (a flag, file, setting or",
        "trace it cannot use, said in one line that names it), and 1 on an internal error,",
        "which is a bug: `smetric --debug COMMAND ...` (or `SMETRIC_DEBUG=1`) shows its",
        "traceback for the report.",
        "",
    ]
    commands = list(_commands(root, "smetric"))
    out += [f"- [`{full}`](#{full.replace(' ', '-')})" for full, _ in commands]
    for full, command in commands:
        ctx = typer.Context(command, info_name=full)
        out += ["", f"## {full} {{#{full.replace(' ', '-')}}}", ""]
        out.append(f"```text\n{full} {' '.join(command.collect_usage_pieces(ctx))}\n```")
        out += ["", plain(command.help), ""]
        params = [p for p in command.params if p.name != "help"]
        if params:
            out += ["| argument or option | default | what it does |", "|---|---|---|"]
            for param in params:
                help_text = plain(getattr(param, "help", None))
                if getattr(param, "required", False):
                    help_text += " (required)"
                out.append(f"| {_name(param)} | {_default(param)} | {cell(help_text)} |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------- configuration


def _field_notes(cls: type) -> dict[str, str]:
    """Per field of ``cls``: its attribute docstring, else the comment lines above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    notes: dict[str, str] = {}
    statements = body.body
    for i, node in enumerate(statements):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        after = statements[i + 1] if i + 1 < len(statements) else None
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            notes[name] = inspect.cleandoc(after.value.value)
            continue
        comments: list[str] = []
        row = node.lineno - 2
        while row >= 0 and lines[row].strip().startswith("#"):
            comments.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        notes[name] = " ".join(comments)
    return notes


def _type_name(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return str(text or annotation).replace("typing.", "")


def _field_default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "required"
    if isinstance(value, tuple | frozenset):
        value = list(value)
    return f"`{value}`"


def _declared_help(f: dataclasses.Field) -> str:
    """The help a field declares in its metadata (a ``help`` string, or an object with a
    ``help`` and optionally its bounds and choices), or ""."""
    if isinstance(f.metadata.get("help"), str):
        return f.metadata["help"]
    for value in f.metadata.values():
        if isinstance(getattr(value, "help", None), str):
            text = value.help
            if getattr(value, "choices", None):
                text += f" One of: {', '.join(map(str, value.choices))}."
            elif getattr(value, "bounded", False):
                text += f" Range: {value.range()}."
            return text
    return ""


def flag_help(command: str) -> dict[str, str]:
    """Per setting: the help of the ``smetric COMMAND`` flag that sets it, where one does:
    the flag of its own name, or of its name less ``_s`` (seconds) or ``s`` (a list)."""
    from smetric.cli.app import command as cli_command

    params = cli_command(command).params
    out: dict[str, str] = {}
    for param in params:
        text = plain(getattr(param, "help", None))
        for name in (param.name, f"{param.name}_s", f"{param.name}s"):
            out.setdefault(name, text)
    return out


def dataclass_table(
    cls: type, keys: tuple[str, ...] | None = None, flags: dict[str, str] | None = None
) -> list[str]:
    """One row per field of ``cls`` (only ``keys`` if given): name, type, default, notes
    (the field's declared help, else its comment, else the help of the flag that sets it)."""
    notes = _field_notes(cls)
    flags = flags or {}
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if keys is not None and f.name not in keys:
            continue
        if dataclasses.is_dataclass(f.type) or f.name in ("cluster", "workload", "slo"):
            continue
        note = _declared_help(f) or notes.get(f.name) or flags.get(f.name, "")
        rows.append(
            f"| `{f.name}` | `{cell(_type_name(f.type))}` | {_field_default(f)} | {cell(note)} |"
        )
    return rows


def settings_table(cls: type, flags: Sequence[Any] = (), only: Iterable[str] = ()) -> list[str]:
    """One row per setting of ``cls`` (only the fields ``only`` names, if any): key, the
    flag of ``flags`` (``cli.settings_options.SettingFlag``) that sets it, type, default
    and help, from the one declaration both the key and the flag are generated from."""
    from smetric.core.settings import settings_of

    decls = {flag.field: flag.decls for flag in flags}
    kept = set(only)
    columns = ["key", *(["flag"] if flags else []), "type", "default", "meaning"]
    rows = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for f, _ in settings_of(cls):
        if kept and f.name not in kept:
            continue
        default = '`""`' if f.default == "" else _field_default(f)
        cells = [f"`{f.name}`", f"`{cell(_type_name(f.type))}`", default]
        if flags:
            cells.insert(1, cell(" ".join(f"`{d}`" for d in decls.get(f.name, ()))))
        rows.append("| " + " | ".join([*cells, cell(_declared_help(f))]) + " |")
    return rows


def router_config() -> list[str]:
    from smetric.cli.pick import PICK_FLAGS
    from smetric.cli.serve import SERVE_FLAGS
    from smetric.gateway.options import PickOptions
    from smetric.serve.config import (
        ColocatedEngine,
        EngineEntry,
        KVEvents,
        ServeConfig,
        ServeOptions,
    )

    return [
        "## Router: `smetric serve --config`, `smetric pick --config`",
        "",
        "Every key is also a flag of the same meaning (the table names it), and every flag",
        "a key; a flag wins over the file, except that engines of `--engine`,",
        "`--prefill-engine` and `--decode-engine` join those of the file. A key the",
        "command does not take, or a value of the wrong type or range, is an error naming",
        "the file and the key.",
        "",
        "```yaml",
        "engines:",
        "- http://10.0.0.1:8000",
        "- {url: http://10.0.0.2:8000, kv_blocks: 8192,",
        "   kv_events: {endpoint: 'tcp://10.0.0.2:5557', bind: false}}",
        "router: {policy: smetric_cost, retries: 2, scrape_interval_s: 1.0}",
        "```",
        "",
        "### Top level",
        "",
        *settings_table(ServeConfig, SERVE_FLAGS),
        "",
        f"### An engine of `engines:` ({ColocatedEngine.__name__})",
        "",
        "A URL, or a mapping of these keys; one of `prefill_engines:` or `decode_engines:`",
        f"takes only {', '.join(f'`{f.name}`' for f in dataclasses.fields(EngineEntry))}.",
        "",
        *settings_table(ColocatedEngine),
        "",
        f"### `kv_events:` ({KVEvents.__name__})",
        "",
        plain(inspect.getdoc(KVEvents)),
        "",
        *settings_table(KVEvents),
        "",
        f"### `router:` of `smetric serve` ({ServeOptions.__name__})",
        "",
        *settings_table(ServeOptions, SERVE_FLAGS),
        "",
        f"### `router:` of `smetric pick` ({PickOptions.__name__})",
        "",
        "The keys of `smetric serve` but `workers` and `decode_policy` (the picker does not",
        "serve disaggregated clusters), with the picker's own ports and shedding:",
        "",
        *settings_table(PickOptions, PICK_FLAGS, PickOptions.__annotations__),
    ]


def config_page() -> str:
    from smetric.sim.config import ClusterConfig, SimConfig, SLOConfig, WorkloadConfig

    simulate = flag_help("simulate")

    def doc(cls: type) -> str:
        text = inspect.getdoc(cls) or ""
        return "" if text.startswith(cls.__name__ + "(") else text

    out = [
        "# Configuration",
        "",
        "The keys a `--config` YAML file may set, generated from the settings dataclasses at",
        "each build of this site. Flags of the same meaning win over the file.",
        "",
        "## Simulation: `smetric simulate`, `sweep`, `knee` `--config`",
        "",
        "A run writes its resolved configuration as `config.yaml` beside its results;",
        "`smetric simulate --config RESULT/config.yaml` runs it again exactly.",
        "",
        "```yaml",
        "cluster: {instances: 16, global_capacity: 1x}",
        "workload: {trace: sample:weka, session_rate: 0.1, duration_s: 1800}",
        "slo: {ttft_base_s: 1.0}",
        "policies: [smetric, smetric_cost, least_load]",
        "warmup_s: 600",
        "```",
        "",
        f"### Top level ({SimConfig.__name__})",
        "",
        *dataclass_table(SimConfig, flags=simulate),
    ]
    for section, cls in (("cluster", ClusterConfig), ("workload", WorkloadConfig)):
        table = dataclass_table(cls, flags=simulate)
        out += ["", f"### `{section}:` ({cls.__name__})", "", doc(cls), "", *table]
    out += ["", f"### `slo:` ({SLOConfig.__name__})", "", doc(SLOConfig), ""]
    out += dataclass_table(SLOConfig, flags=simulate)
    out += ["", *router_config()]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------- metrics


def _families() -> Iterator[tuple[str, str, str, list[str]]]:
    """(name, type, help, labels) of every metric a router's registry exports."""
    from prometheus_client.metrics import MetricWrapperBase

    from smetric.core.kv_events import EventIndex
    from smetric.serve.kv_subscriber import KVEventSubscriber
    from smetric.serve.metrics import RouterMetrics, SubscriberCollector

    engine = "http://engine:8000"
    metrics = RouterMetrics("smetric", [engine])
    # Never started: a subscriber opens its sockets only then, and exports its state now.
    subscriber = KVEventSubscriber(EventIndex(16), "tcp://127.0.0.1:5557", "")
    metrics.registry.register(SubscriberCollector({engine: subscriber}))
    wrappers = {
        m._name: list(m._labelnames)
        for m in vars(metrics).values()
        if isinstance(m, MetricWrapperBase)
    }
    for family in metrics.registry.collect():
        labels = sorted({k for s in family.samples for k in s.labels} - {"le"})
        name = family.name + ("_total" if family.type == "counter" else "")
        yield name, family.type, family.documentation, labels or wrappers.get(family.name, [])


def metrics_page() -> str:
    out = [
        "# Prometheus metrics",
        "",
        "What `smetric serve` exports on `/metrics`, generated from the router's registry at",
        "each build of this site. With `--workers N`, whichever worker takes a scrape answers",
        "for all of them: counters and histograms summed over workers, per-engine gauges from",
        "the load table they share.",
        "`/metrics` needs the API key when `--api-key` is set, unless `--open-metrics`.",
        "",
        "| metric | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for name, kind, help_text, labels in sorted(_families()):
        shown = ", ".join(f"`{label}`" for label in labels) or "—"
        out.append(f"| `{name}` | {kind} | {shown} | {cell(help_text)} |")
    out += [
        "",
        "`smetric_kv_events_total{kind}` takes one `kind` per field of the subscriber's",
        "counters: "
        + ", ".join(f"`{f.name}`" for f in _subscriber_fields())
        + ". The mock engine (`smetric engine`) exports vLLM's own metric names.",
    ]
    return "\n".join(out) + "\n"


def _subscriber_fields() -> list[dataclasses.Field]:
    from smetric.serve.kv_subscriber import SubscriberCounters

    return list(dataclasses.fields(SubscriberCounters))


# ------------------------------------------------------------------------ policies


def policies_page() -> str:
    from smetric.core.policies.registry import DEFAULT_POLICY, POLICIES, parameters

    sources = {
        "tuned": "set by hand",
        "hardware": "derived from the hardware",
        "learned": "fitted to measurements",
    }
    out = [
        "# Routing policies",
        "",
        "Every policy a command takes (`--policy NAME` or `-p NAME:key=value,...`), generated",
        "from the policy registry at each build of this site. What the rules mean and when",
        "each wins: [Policies and branches](../concepts/policies.md). The default policy of",
        f"`smetric serve` is `{DEFAULT_POLICY}`.",
    ]
    for name, cls in POLICIES.items():
        kind = "one of the project's own policies" if cls.ours else "a baseline"
        out += ["", f"## `{name}`", "", f"*{kind.capitalize()}.* " + plain(_doc(cls)), ""]
        out.append("Branches: " + ", ".join(f"`{b}`" for b in cls.branches) + ".")
        params = parameters(name)
        if params:
            out += ["", "| parameter | default | range | value | meaning |"]
            out.append("|---|---|---|---|---|")
            for key, (f, meta) in params.items():
                bounds = meta.range() if meta.bounded else "—"
                if meta.choices:
                    bounds = ", ".join(meta.choices)
                source = sources[meta.source]
                if meta.rate is not None:
                    source += f" (`{meta.rate}`)"
                out.append(
                    f"| `{key}` | `{f.default}` | {cell(bounds)} | {source} | {cell(meta.help)} |"
                )
    return "\n".join(out) + "\n"


def _doc(cls: type) -> str:
    return " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())


# --------------------------------------------------------------------------- hooks

PAGES: dict[str, Callable[[], str]] = {
    CLI_PAGE: cli_page,
    CONFIG_PAGE: config_page,
    METRICS_PAGE: metrics_page,
    POLICIES_PAGE: policies_page,
}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for uri, page in PAGES.items():
        files.append(File.generated(config, uri, content=page()))
    return files


if __name__ == "__main__":
    wanted = {
        "cli": CLI_PAGE,
        "configuration": CONFIG_PAGE,
        "metrics": METRICS_PAGE,
        "policies": POLICIES_PAGE,
    }
    print(PAGES[wanted[sys.argv[1]]](), end="")
