"""Rebuild kuberay-rayservice-v1.json from KubeRay's CRD: python extract.py ray.io_rayservices.yaml COMMIT.

The CRD (ray-operator/config/crd/bases/ray.io_rayservices.yaml in github.com/ray-project/kuberay) is 1 MB, mostly
pod templates and status. Kept: the v1 schema of `spec`, whole; pruned: `status`, and the head's and the worker
groups' `template` (PodTemplateSpecs, which tests/test_kubernetes.py validates with kubernetes-validate instead).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

PRUNED = {"type": "object", "x-pruned": "a PodTemplateSpec: validated as a PodTemplate by kubernetes-validate"}


def excerpt(crd: dict, commit: str) -> dict:
    """Group, kind, the served v1 version and its schema with the pod templates and status pruned."""
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = version["schema"]["openAPIV3Schema"]
    schema["properties"].pop("status", None)
    cluster = schema["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"]
    cluster["headGroupSpec"]["properties"]["template"] = dict(PRUNED)
    cluster["workerGroupSpecs"]["items"]["properties"]["template"] = dict(PRUNED)
    return {
        "source": "github.com/ray-project/kuberay ray-operator/config/crd/bases/ray.io_rayservices.yaml @ " + commit,
        "group": crd["spec"]["group"],
        "kind": crd["spec"]["names"]["kind"],
        "version": version["name"],
        "served": version["served"],
        "openAPIV3Schema": schema,
    }


if __name__ == "__main__":
    crd_path, commit = sys.argv[1], sys.argv[2]
    data = excerpt(yaml.safe_load(Path(crd_path).read_text()), commit)
    out = Path(__file__).with_name("kuberay-rayservice-v1.json")
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
