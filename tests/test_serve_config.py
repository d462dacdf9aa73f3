"""The router's settings, declared once: every flag of serve and pick is a YAML key and
every key a flag, both checked alike, and --help shows each declared default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from smetric.cli import app
from smetric.cli.settings_options import flag_names, flag_type, given_of
from smetric.core.settings_load import Leaf, leaves
from smetric.engine import EngineConfig
from smetric.gateway.options import PickConfig
from smetric.serve.config import (
    ColocatedEngine,
    ServeConfig,
    engines_from,
    load_config,
    router_settings,
    with_flags,
)

COMMANDS = {"serve": ServeConfig, "pick": PickConfig}


def command(name: str) -> Any:
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def file_keys(cls: type) -> set[str]:
    """Every key a config file of ``cls`` may set, enumerated from what ``load`` accepts:
    the top level's settings and each section's."""
    keys = set()
    for f in dataclasses.fields(cls):
        section = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(section):
            keys |= {g.name for g in dataclasses.fields(section)}
        else:
            keys.add(f.name)
    return keys


@pytest.mark.parametrize("name", COMMANDS)
def test_every_flag_is_a_file_key_and_every_key_a_flag(name: str) -> None:
    flags = {p.name for p in command(name).params} - {"config", "help"}
    assert flags == file_keys(COMMANDS[name])


def other_value(leaf: Leaf) -> tuple[Any, list[str]]:
    """A value of the setting other than its default, as YAML and as command-line words."""
    meta, default = leaf.meta, leaf.field.default
    flag = flag_names(leaf)[0].split("/")[0]
    scalar = flag_type(leaf)
    if meta.choices:
        value: Any = next(c for c in meta.choices if c != default)
    elif isinstance(default, bool) or leaf.hint == bool | None:
        return True, [flag]
    elif isinstance(default, int) and not isinstance(default, bool):
        value = default + 1 if meta.le is None or default + 1 <= meta.le else default - 1
    elif isinstance(default, float):
        value = default + 1.5
    elif isinstance(default, tuple | frozenset):
        value = ["http://127.0.0.1:9"]
        return value, [flag, value[0]]
    elif scalar in (Path, Path | None):
        value = "/tmp/elsewhere"
    else:
        value = f"{default}-other" if default else "dns://engines.local:80"
    return value, [flag, str(value)]


@pytest.mark.parametrize("name", COMMANDS)
def test_a_flag_and_its_key_set_the_same_setting(name: str, tmp_path: Path) -> None:
    cls, cmd = COMMANDS[name], command(name)
    sections = {f.name for f in dataclasses.fields(cls) if "setting" not in f.metadata}
    top = {f.name for f in dataclasses.fields(cls)} - sections
    for leaf in leaves(cls):
        key = leaf.field.name
        value, words = other_value(leaf)
        document = {key: value} if key in top else {"router": {key: value}}
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump(document))
        from_file = load_config(cls, path)
        ctx = cmd.make_context(name, words)
        from_flag = with_flags(cls(), given_of(ctx, [key]))
        assert from_file == from_flag != cls(), key


def help_text(name: str) -> str:
    result = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


def shown_default(leaf: Leaf) -> str | None:
    default = leaf.field.default
    if default is None or default in ((), frozenset()):
        return None
    if isinstance(default, bool):
        on, _, off = flag_names(leaf)[0].partition("/")
        return (on if default else off).removeprefix("--")
    return str(default)


@pytest.mark.parametrize(("name", "cls"), [*COMMANDS.items(), ("engine", EngineConfig)])
def test_help_describes_every_option_and_shows_its_declared_default(name: str, cls: type) -> None:
    text = help_text(name)
    declared = list(leaves(cls))
    flags = [flag_names(leaf)[0].split("/")[0] for leaf in declared]
    positions = [text.index(f" {flag} ") for flag in flags]
    ends = sorted([*positions, len(text)])
    for leaf, start in zip(declared, positions, strict=True):
        passage = text[start : next(e for e in ends if e > start)]
        assert leaf.meta.help.split()[0] in passage, leaf.field.name
        shown = shown_default(leaf)
        if shown is not None:
            assert f"[default: {shown}]" in passage, (leaf.field.name, passage)
    for param in command(name).params:
        assert param.help, f"{name} {param.name} has no description"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "router.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            "engines: [{url: 'http://127.0.0.1:1', kv_blcks: 8}]",
            "unknown key 'engines[0].kv_blcks'",
        ),
        (
            "engines: [{url: 'http://127.0.0.1:1', kv_blcks: 8}]",
            "url, kv_blocks, backend, kv_events",
        ),
        ("engines: [{url: 'http://127.0.0.1:1', backend: tgi}]", "'tgi': use one of vllm"),
        ("engines: [{kv_blocks: 8}]", "engines[0].url is required"),
        ("engines: [{url: 'http://h:1', kv_events: {topic: t}}]", "kv_events.endpoint is required"),
        ("router: {kv_blocks: 0}", "router.kv_blocks must lie in [1, inf], got 0"),
        ("router: {block_sise: 16}", "unknown key 'router.block_sise'; router takes policy"),
        ("router: {first_byte_timeout_s: 0}", "router.first_byte_timeout_s must lie in (0, inf]"),
        ("router: {log_level: loud}", "'loud': use one of debug, info, warning, error"),
        ("router: {port: 70000}", "router.port must lie in [1, 65535]"),
        ("router: {workers: many}", "router.workers must be an integer, got 'many'"),
        ("router: {api_keys: [k1, 2]}", "router.api_keys[1] must be a string, got 2"),
        ("prefill_engines: [{url: 'http://h:1', backend: vllm}]", "prefill_engines[0].backend"),
        ("router: [1, 2", "not valid YAML"),
        ("- http://127.0.0.1:1", "the top level must map keys to values"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_file_and_the_key(
    tmp_path: Path, text: str, said: str
) -> None:
    path = write(tmp_path, text + "\n")
    result = CliRunner().invoke(app, ["serve", "--config", str(path)], env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert str(path) in result.output and said in " ".join(result.output.split())


def test_a_yaml_syntax_error_names_the_file_and_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "router:\n  retries: [1\n")
    with pytest.raises(ValueError, match=re.escape(f'in "{path}", line 3')):
        load_config(ServeConfig, path)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--retries", "-1"], "--retries"),
        (["--first-byte-timeout", "0"], "(0, inf]"),
        (["--global-tier", "cpu"], "--global-tier"),
        (["--log-level", "loud"], "--log-level"),
    ],
)
def test_a_bad_flag_is_refused_before_anything_starts(args: list[str], said: str) -> None:
    result = CliRunner().invoke(app, ["serve", "-e", "http://127.0.0.1:1", *args])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert said in result.output


def test_flags_win_over_the_file_and_engines_of_both_are_served(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "engines:\n- http://127.0.0.1:1\n- {url: 'http://127.0.0.1:2', kv_blocks: 64}\n"
        "router: {retries: 0, policy: least_load, kv_blocks: 128}\n",
    )
    ctx = command("serve").make_context("serve", ["-e", "http://127.0.0.1:3", "--retries", "4"])
    config = with_flags(load_config(ServeConfig, path), given_of(ctx, ["engines", "retries"]))
    assert config.engines == (
        "http://127.0.0.1:1",
        ColocatedEngine("http://127.0.0.1:2", 64),
        "http://127.0.0.1:3",
    )
    settings = router_settings(config.router)
    assert (settings.retries, settings.policy) == (4, "least_load")
    engines, _ = engines_from(config.engines, config.router.kv_blocks, settings.block_size)
    assert [e.kv_blocks for e in engines] == [128, 64, 128]
