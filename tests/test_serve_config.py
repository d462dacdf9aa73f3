"""The router's settings, declared once: every flag of serve and pick is a YAML key and
every key a flag, both checked alike, and --help shows each declared default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from smetric.cli import app
from smetric.cli.app import command
from smetric.cli.engine import ENGINE_FLAGS
from smetric.cli.pick import PICK_FLAGS
from smetric.cli.serve import SERVE_FLAGS, resolved
from smetric.cli.settings_options import SettingFlag, given_settings
from smetric.gateway.options import PickConfig
from smetric.serve.app import RouterSettings
from smetric.serve.config import (
    ColocatedEngine,
    ServeConfig,
    engines_from,
    load_config,
    router_settings,
)

COMMANDS = {"serve": ServeConfig, "pick": PickConfig}
FLAGS = {"serve": SERVE_FLAGS, "pick": PICK_FLAGS, "engine": ENGINE_FLAGS}


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


def other_value(flag: SettingFlag) -> tuple[Any, list[str]]:
    """A value of the setting other than its default, as YAML and as command-line words."""
    meta, default, hint = flag.meta, flag.default, flag.annotation
    if meta.choices:
        value: Any = next(c for c in meta.choices if c != default)
    elif hint in (bool, bool | None):
        return True, [flag.flag]
    elif hint is int:
        value = default + 1 if meta.le is None or default + 1 <= meta.le else default - 1
    elif hint is float:
        value = default + 1.5
    elif hint == list[str]:
        value = ["http://127.0.0.1:9"]
        return value, [flag.flag, value[0]]
    elif hint in (Path, Path | None):
        value = "/tmp/elsewhere"
    else:
        value = f"{default}-other" if default else "dns://engines.local:80"
    return value, [flag.flag, str(value)]


def from_words(name: str, words: list[str]) -> Any:
    """The config the command line ``words`` of command ``name`` sets, with no file."""
    ctx = command(name).make_context(name, words)
    return resolved(COMMANDS[name], None, given_settings(FLAGS[name], ctx.params, ctx))


@pytest.mark.parametrize("name", COMMANDS)
def test_a_flag_and_its_key_set_the_same_setting(name: str, tmp_path: Path) -> None:
    cls = COMMANDS[name]
    for flag in FLAGS[name]:
        value, words = other_value(flag)
        document = {flag.field: value} if not flag.section else {"router": {flag.field: value}}
        path = tmp_path / f"{flag.field}.yaml"
        path.write_text(yaml.safe_dump(document))
        assert load_config(cls, path) == from_words(name, words) != cls(), flag.key


def help_text(name: str) -> str:
    # Wide enough that no row wraps: a flag's second name (--no-...) sits below its
    # first, and would land inside a wrapped help text once the lines are joined.
    result = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


def shown_default(flag: SettingFlag) -> str | None:
    default = flag.default
    if default is None:
        return None
    if isinstance(default, bool):
        name = flag.flag.removeprefix("--")
        return name if default else f"no-{name}"
    return str(default)


@pytest.mark.parametrize("name", FLAGS)
def test_help_describes_every_option_and_shows_its_declared_default(name: str) -> None:
    text = help_text(name)
    flags = FLAGS[name]
    # A name is followed by a space, or by ", -x" where it has a short form.
    found = [re.search(rf" {re.escape(flag.flag)}[ ,]", text) for flag in flags]
    assert all(found), [flag.flag for flag, at in zip(flags, found, strict=True) if not at]
    positions = [at.start() for at in found if at is not None]
    ends = sorted([*positions, len(text)])
    for flag, start in zip(flags, positions, strict=True):
        passage = text[start : next(e for e in ends if e > start)]
        assert flag.meta.help.split()[0] in passage, flag.key
        shown = shown_default(flag)
        if shown is not None:
            assert f"[default: {shown}]" in passage, (flag.key, passage)
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
            "url, kv_blocks, api_key, backend, kv_events",
        ),
        ("engines: [{url: 'http://127.0.0.1:1', backend: tgi}]", "'tgi': use one of vllm"),
        ("engines: [{kv_blocks: 8}]", "engines[0].url is required"),
        ("engines: [{url: 'http://h:1', kv_events: {topic: t}}]", "kv_events.endpoint is required"),
        ("router: {kv_blocks: 0}", "router.kv_blocks must lie in [1, inf], got 0"),
        ("router: {block_sise: 16}", "unknown key 'router.block_sise'; router takes policy"),
        ("router: {first_byte_timeout_s: 0}", "router.first_byte_timeout_s must lie in (0, inf]"),
        ("router: {log_level: loud}", "'loud': use one of debug, info, warning, error"),
        ("router: {port: 70000}", "router.port must lie in [0, 65535]"),
        ("router: {workers: many}", "router.workers must be an integer, got 'many'"),
        ("router: {api_keys: [k1, 2]}", "router.api_keys[1] must be a string, got 2"),
        ("router: {api_keys: [k1, '']}", "api_keys: an item must not be empty"),
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
        (["--api-key", ""], "an item must not be empty"),
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
    config = resolved(ServeConfig, path, given_settings(SERVE_FLAGS, ctx.params, ctx))
    assert config.engines == (
        "http://127.0.0.1:1",
        ColocatedEngine("http://127.0.0.1:2", 64),
        "http://127.0.0.1:3",
    )
    settings = router_settings(config.router)
    assert (settings.retries, settings.policy) == (4, "least_load")
    engines, _ = engines_from(config.engines, config.router.kv_blocks, settings.block_size)
    assert [e.kv_blocks for e in engines] == [128, 64, 128]


@pytest.mark.parametrize(
    ("values", "said"),
    [
        ({"api_keys": frozenset({"k1", " "})}, "api_keys: an item must not be empty"),
        ({"health_interval_s": 0.001}, "health_interval_s must lie in [0.05, inf]"),
        ({"global_tier": "cpu"}, "global_tier 'cpu': use one of"),
    ],
)
def test_router_settings_built_in_code_are_checked_as_a_file_is(
    values: dict[str, Any], said: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        RouterSettings(**values)
