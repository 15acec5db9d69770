"""Validation of Kubernetes manifests against the real schemas: the core kinds with ``kubernetes-validate`` (the
API server's OpenAPI schemas), the Prometheus Operator's kinds with their CRDs' ``openAPIV3Schema``
(tests/schemas/, see its README), made strict as ``kubectl apply --validate=strict`` is: an unknown field is an
error, never silently pruned (a snake_case key in a camelCase resource would otherwise vanish)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUBERNETES_VERSION = "1.30.0"
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
             ("monitoring.coreos.com/v1alpha1", "AlertmanagerConfig")}


def strict(schema: Any) -> Any:
    """The schema with every object's unknown fields an error (unless the CRD keeps them on purpose)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    version = api_version.rsplit("/", 1)[1]
    schema: dict[str, Any] = strict(json.loads((SCHEMAS / f"{kind.lower()}-{version}.json").read_text()))
    # metadata is the API server's ObjectMeta, which the CRD leaves open: check the fields we write
    schema["properties"]["metadata"] = {"type": "object", "additionalProperties": False, "required": ["name"],
                                        "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                                       "labels": {"type": "object",
                                                                  "additionalProperties": {"type": "string"}}}}
    return schema


def validate(manifest: dict[str, Any]) -> None:
    """Raise a ValidationError naming the path of the first field the schema rejects."""
    key = (manifest["apiVersion"], manifest["kind"])
    if key not in CRD_KINDS:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        return
    schema = crd_schema(*key)
    # the CRDs hold Go regular expressions (inline flags mid-pattern) that Python's cannot compile: the schema
    # itself is not checked, only the manifests against it (none of ours reaches those fields)
    jsonschema.Draft7Validator(schema).validate(manifest)
    if manifest["kind"] == "AlertmanagerConfig":
        # the CRD leaves sub-routes open (a recursive type); the operator reads each as a route
        route = schema["properties"]["spec"]["properties"]["route"]
        pending = list(manifest["spec"]["route"].get("routes", []))
        while pending:
            sub = pending.pop()
            jsonschema.Draft7Validator(route).validate(sub)
            pending.extend(sub.get("routes", []))
