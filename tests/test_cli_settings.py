"""Flags generated from the settings' declaration: every YAML key of a simulation command
is a flag of it and every setting flag a key, ``--help`` shows the declared defaults, a
flag is checked with the YAML file's error, and a flag's default never overrides a file."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from smetric.cli import app
from smetric.cli.app import command as cli_command
from smetric.cli.settings_options import Given, setting_flags, with_setting_flags
from smetric.cli.sim_options import EXCLUDED, NOT_FLAGS, SIM_FLAGS, command_config
from smetric.core.settings import setting, settings_of
from smetric.eval.plan import PlanSettings
from smetric.sim.config import SECTIONS, SimConfig
from smetric.sim.knee import KneeSettings

runner = CliRunner()
COMMANDS = ("simulate", "sweep", "knee", "plan")


def yaml_keys() -> set[str]:
    """Every key a simulation YAML file may set, as its errors name them."""
    top = {f.name for f in dataclasses.fields(SimConfig) if f.name not in SECTIONS}
    inner = {
        f"{section}.{f.name}"
        for section in SECTIONS
        for f in dataclasses.fields(getattr(SimConfig(), section))
    }
    return top | inner


def command_params(command: str) -> dict[str, Any]:
    return {p.name: p for p in cli_command(command).params}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_yaml_key_is_a_flag_and_every_setting_flag_a_key(command: str) -> None:
    params = command_params(command)
    by_field = {flag.field: flag.key for flag in SIM_FLAGS}
    flagged = {by_field[name] for name in params if name in by_field}
    # The generated flags and the documented exceptions cover every key, once.
    assert flagged == yaml_keys() - set(NOT_FLAGS) - set(EXCLUDED[command])
    assert not set(NOT_FLAGS) & set(EXCLUDED[command])
    assert all(EXCLUDED[command].values()) and all(NOT_FLAGS.values())
    # What the exceptions name instead exists.
    assert params["source"].param_type_name == "argument"
    assert "--policies" in params["policies"].opts
    # Every key takes its own name as a flag, whatever short name it also takes.
    for name in params:
        if name in by_field:
            key = by_field[name].rpartition(".")[2]
            flag = next(f for f in SIM_FLAGS if f.field == name)
            own = "--trace-format" if key == "format" else "--" + key.replace("_", "-")
            assert own == flag.flag


def test_the_flags_keep_the_short_names_they_have_always_had() -> None:
    opts = {o for p in command_params("simulate").values() for o in (*p.opts, *p.secondary_opts)}
    short = "--gpus --mem-util --kv-tokens --max-batched-tokens --global --nic-bandwidth --rate"
    short += " --duration --warmup --ttft-base --ttft-per-token --tpot --open-loop --closed-loop"
    assert set(short.split()) <= opts


def test_help_shows_each_setting_flags_declared_default() -> None:
    result = runner.invoke(app, ["simulate", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    rows = result.output.splitlines()
    starts = [i for i, row in enumerate(rows) if re.match(r"^│ --", row)]
    shown = 0
    for flag in SIM_FLAGS:
        if flag.default is None:
            continue
        first = next(i for i in starts if rows[i].startswith(f"│ {flag.flag}"))
        following = [i for i in starts if i > first] + [len(rows)]
        text = " ".join(rows[first : following[0]])
        default = (
            ("open-loop" if flag.default else "closed-loop")
            if flag.annotation is bool
            else flag.default
        )
        assert f"[default: {default}]" in text, flag.flag
        shown += 1
    assert shown >= 30


def test_a_flag_out_of_bounds_is_the_yaml_files_error(tmp_path: Path) -> None:
    flag = runner.invoke(app, ["simulate", "--instances", "0", "-o", str(tmp_path)])
    assert flag.exit_code == 2
    assert "--instances must lie in [1, inf], got 0" in flag.output
    config = tmp_path / "c.yaml"
    config.write_text("cluster: {instances: 0}\n")
    yaml = runner.invoke(app, ["simulate", "-c", str(config), "-o", str(tmp_path)])
    assert yaml.exit_code == 2
    assert "cluster.instances must lie in [1, inf], got 0" in yaml.output
    share = runner.invoke(app, ["knee", "--kv-dtype", "fp8", "--sample", "2"])
    assert share.exit_code == 2 and "--sample must lie in (0, 1.0], got 2.0" in share.output
    mode = runner.invoke(app, ["sweep", "--kv-load", "later"])
    assert mode.exit_code == 2 and "--kv-load 'later': use one of sync, async" in mode.output


def test_a_flag_overrides_the_file_and_a_default_never_does(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("cluster: {instances: 3}\nworkload: {duration_s: 60, seed: 4}\n")
    from_file = command_config(Given({}), config, None, None)
    assert (from_file.cluster.instances, from_file.workload.seed) == (3, 4)
    given = Given({"cluster.instances": 5, "warmup_s": 10.0})
    overridden = command_config(given, config, "sample:mooncake", "smetric,least_load")
    assert overridden.cluster.instances == 5 and overridden.warmup_s == 10.0
    assert overridden.workload.duration_s == 60 and overridden.workload.seed == 4
    assert overridden.workload.trace == "sample:mooncake"
    assert overridden.policies == ("smetric", "least_load")


@dataclass(frozen=True)
class Toy:
    count: int = setting(3, "How many.", ge=1)
    ratio: float = setting(0.5, "What share.", gt=0, le=1.0)
    mode: str = setting("fast", "How.", choices=("fast", "slow"))
    label: str | None = setting(None, "A name; none: unnamed.")


def toy_app(seen: list[Given]) -> typer.Typer:
    toy = typer.Typer()
    flags = setting_flags(Toy, "toy", names={"count": ("--count", "-n")})

    @toy.command()
    @with_setting_flags(flags)
    def run(given: Given, extra: int = 0) -> None:
        seen.append(given)

    return toy


def test_only_the_flags_a_command_line_gives_reach_the_command() -> None:
    seen: list[Given] = []
    toy = toy_app(seen)
    assert runner.invoke(toy, []).exit_code == 0
    assert seen[-1].values == {}
    # A flag given at its default value is still given: it overrides a file.
    assert runner.invoke(toy, ["-n", "3", "--label", "x", "--extra", "2"]).exit_code == 0
    assert seen[-1].values == {"toy.count": 3, "toy.label": "x"}
    assert seen[-1].section("toy") == {"count": 3, "label": "x"}
    assert seen[-1].section("") == {}
    assert "toy.count" in seen[-1] and "toy.ratio" not in seen[-1]


def test_a_toy_flag_is_checked_and_shows_its_declaration() -> None:
    seen: list[Given] = []
    toy = toy_app(seen)
    bad = runner.invoke(toy, ["--ratio", "0"])
    assert bad.exit_code == 2 and "--ratio must lie in (0, 1.0], got 0.0" in bad.output
    choice = runner.invoke(toy, ["--mode", "medium"])
    assert choice.exit_code == 2 and "--mode 'medium': use one of fast, slow" in choice.output
    assert not seen
    page = runner.invoke(toy, ["--help"], env={"COLUMNS": "200"}).output
    assert "How many. Range: [1, inf]." in page and "[default: 3]" in page
    assert "How. One of: fast, slow." in page and "[default: fast]" in page
    declared = {f.name for f, _ in settings_of(Toy)}
    assert all(f"--{name}" in page for name in declared)


@pytest.mark.parametrize(
    ("command", "cls", "own"),
    [("knee", KneeSettings, None), ("plan", KneeSettings, "start"), ("plan", PlanSettings, None)],
)
def test_the_search_flags_are_their_settings_declaration(
    command: str, cls: type, own: str | None
) -> None:
    # KneeSettings and PlanSettings declare the knee and plan flags: the default and help
    # shown are the field's (plan sets --start itself: the trace's own load).
    params = command_params(command)
    for f, meta in settings_of(cls):
        if f.name == own:
            assert f.name not in params
            continue
        assert params[f.name].default == f.default
        assert meta.help in params[f.name].help


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--precision", "1"], "--precision must lie in (1, inf], got 1.0"),
        (["knee", "--max-probes", "1"], "--max-probes must lie in [2, inf], got 1"),
        (["plan", "--attainment", "1.5"], "--attainment must lie in (0, 1], got 1.5"),
    ],
)
def test_a_search_flag_out_of_bounds_is_refused_naming_it(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
