"""The deployment manifests, validated offline: built-in kinds against the Kubernetes
schemas (``kubernetes-validate``, strict: unknown fields fail), the custom resources against
their CRDs' schemas, and the containers' arguments and configs against the real CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs in the dev dependencies
import kubernetes_validate  # type: ignore[import-untyped]  # ships no types, has no stubs
import pytest
import yaml

from smetric.cli.app import command as cli_command
from smetric.gateway.options import PickConfig
from smetric.serve.config import ServeConfig, load_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
CRDS = Path(__file__).resolve().parent / "data" / "crds"
CUSTOM = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.json",
}


def documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{path.name}: {doc['kind']} {doc['metadata']['name']}", doc)
        for path in sorted(DEPLOY.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def strict(schema: Any) -> Any:
    """A CRD schema that, as the API server does, refuses fields it does not declare."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def test_every_kind_the_deployment_needs_is_there() -> None:
    kinds = {(name.split(":")[0], doc["kind"]) for name, doc in documents()}
    for manifest in ("router.yaml", "picker.yaml"):
        for kind in (
            "ConfigMap",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "HorizontalPodAutoscaler",
            "ServiceMonitor",
        ):
            assert (manifest, kind) in kinds, (manifest, kind)
    assert ("picker.yaml", "InferencePool") in kinds
    assert ("engines.yaml", "Service") in kinds


@pytest.mark.parametrize(("name", "doc"), documents(), ids=[n for n, _ in documents()])
def test_manifest_validates(name: str, doc: dict[str, Any]) -> None:
    custom = CUSTOM.get((doc["apiVersion"], doc["kind"]))
    if custom is None:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    else:
        schema = strict(json.loads((CRDS / custom).read_text()))
        schema["properties"]["metadata"] = {"type": "object"}
        jsonschema.validate(doc, schema)


def test_a_broken_manifest_is_caught() -> None:
    doc = next(d for _, d in documents() if d["kind"] == "Deployment")
    broken = json.loads(json.dumps(doc))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
    pool = next(d for _, d in documents() if d["kind"] == "InferencePool")
    broken = json.loads(json.dumps(pool))
    broken["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    schema = strict(json.loads((CRDS / CUSTOM[(pool["apiVersion"], "InferencePool")]).read_text()))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [
        (name, doc, container)
        for name, doc in documents()
        if doc["kind"] == "Deployment"
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]


@pytest.mark.parametrize(
    ("name", "doc", "container"), containers(), ids=[c[0] for c in containers()]
)
def test_containers_run_real_commands_with_separate_readiness_and_liveness(
    name: str, doc: dict[str, Any], container: dict[str, Any], tmp_path: Path
) -> None:
    ready, live = container["readinessProbe"], container["livenessProbe"]
    assert ready != live
    command, *args = container["args"]
    # The arguments parse as the real CLI parses them (unknown flags and bad values fail).
    cli_command(command).make_context(command, list(args))
    # The config the container mounts loads as the command loads it.
    config = next(a.split("=", 1)[1] for a in args if a.startswith("--config="))
    maps = {d["metadata"]["name"]: d for _, d in documents() if d["kind"] == "ConfigMap"}
    volume = doc["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
    text = maps[volume]["data"][Path(config).name]
    path = tmp_path / Path(config).name
    path.write_text(text)
    configs: dict[str, type[ServeConfig] | type[PickConfig]] = {
        "serve": ServeConfig,
        "pick": PickConfig,
    }
    loaded = load_config(configs[command], path).router
    for key, value in yaml.safe_load(text)["router"].items():
        assert getattr(loaded, key) == value
    # Enough time for the pause before SIGTERM and the drain after it.
    drain = float(next(a.split("=", 1)[1] for a in args if a.startswith("--drain-timeout=")))
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain + pause
