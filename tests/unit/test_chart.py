"""The Helm chart, rendered offline by the real Helm engine (helm-python-sdk), and the
kubectl manifests generated from it.

Every combination of values is linted (strict) and rendered; every object it renders is
checked against Kubernetes 1.30's and 1.37's own schemas (kubernetes-validate, strict) or,
for custom resources, against their CRD's schema. The RBAC rules are compared, both ways,
with what the operator's code calls: ftjob/operator/kube.py's API calls and the kopf
handlers of ftjob/operator/handlers.py, both read with ``ast``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
import shutil
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from ftjob import __version__
from ftjob.api import crd, jobspec, profile
from ftjob.api.profile import parse_profile
from ftjob.operator import startup
from ftjob.operator.__main__ import add_arguments
from ftjob.operator.render import owner_reference

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ftjob"
KUBE_PY = ROOT / "ftjob" / "operator" / "kube.py"
HANDLERS_PY = ROOT / "ftjob" / "operator" / "handlers.py"
KUBE_VERSIONS = ["1.30.0", "1.37.0"]
NAMESPACE = "ftjob-system"


def test_a_peering_lifetime_kopf_cannot_renew_in_time_is_refused_by_the_operator_too():
    """The schema's minimum, for an operator started without the chart."""
    import argparse

    with pytest.raises(argparse.ArgumentError, match="under 10 s.*peering.lifetime"):
        operator_parser().parse_args(["operator", "-A", "--peering-lifetime=9"])
    assert (
        operator_parser().parse_args(["operator", "-A", "--peering-lifetime=10"]).peering_lifetime
        == 10
    )


COMBOS = {
    "defaults": {},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    # The platform's profile from values: examples/profiles/team-a.yaml's spec.
    "default-profile": {
        "profile": {
            "create": True,
            "name": "team-a",
            "spec": yaml.safe_load((ROOT / "examples" / "profiles" / "team-a.yaml").read_text())[
                "spec"
            ],
        }
    },
    "ha-peering": {
        "replicaCount": 2,
        "peering": {"enabled": True, "name": "ftjob-ha", "lifetime": 20},
    },
    "ha-namespaced": {
        "replicaCount": 3,
        "peering": {"enabled": True},
        "watchNamespaces": ["team-a"],
    },
    "monitoring": {
        "metrics": {
            "port": 9400,
            "service": {"annotations": {"prometheus.io/scrape": "true"}},
            "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "kps"}},
        }
    },
    "prometheus-operator-and-grafana": {
        "trainer": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "dashboard": {"enabled": True, "annotations": {"grafana_folder": "ML"}},
    },
    "monitors-in-watched-namespaces": {
        "watchNamespaces": ["team-a", "team-b"],
        "trainer": {"podMonitor": {"enabled": True, "interval": "1m", "scrapeTimeout": "20s"}},
        "dashboard": {
            "enabled": True,
            "label": "example.com/grafana-dashboard",
            "labelValue": "ftjob",
            "namespace": "monitoring",
        },
    },
    "private-registry-gpu-cluster": {
        "image": {"repository": "registry.example.com/ml/ftjob-operator", "tag": "0.1.0-rc1"},
        "imagePullSecrets": [{"name": "regcred"}],
        "trainer": {"defaultImage": "registry.example.com/ml/ftjob-trainer:0.1.0-efa"},
        "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
        "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"}
                            ]
                        }
                    ]
                }
            }
        },
        "priorityClassName": "system-cluster-critical",
        "podLabels": {"team": "ml-platform"},
        "podAnnotations": {"example.com/owner": "ml-platform"},
        "serviceAccount": {"name": "ftjob-operator", "annotations": {"example.com/role": "x"}},
        "operator": {
            "healthPort": 8081,
            "extraArgs": ["--verbose"],
            "env": [{"name": "FTJOB_RESYNC_SECONDS", "value": "60"}],
        },
        "resources": {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
    },
    "no-metrics-own-rbac": {
        "metrics": {"enabled": False},
        "rbac": {"create": False},
        "serviceAccount": {"create": False, "name": "platform-operator"},
        "fullnameOverride": "finetune",
    },
}


def render(values: dict, namespace: str = NAMESPACE) -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values, name="ftjob", namespace=namespace, is_install=True)


def objects(values: dict) -> list[dict]:
    out = []
    for path, text in sorted(render(values).items()):
        if path.endswith(".yaml"):
            out += [d for d in yaml.safe_load_all(text) if d]
    return out


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: objects(values) for name, values in COMBOS.items()}


def the(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


# -- lint, render, validate -------------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_lint_is_clean_in_strict_mode(combo, kube):
    report = helm.lint(str(CHART), COMBOS[combo], strict=True, kube_version=f"v{kube}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("combo", COMBOS)
def test_every_rendered_object_is_valid_kubernetes(combo, rendered):
    crd_schemas = {(c["spec"]["group"], c["spec"]["names"]["kind"]): c for c in chart_crds()}
    objs = rendered[combo]
    assert objs
    for obj in objs:
        group = obj["apiVersion"].rpartition("/")[0]
        if (group, obj["kind"]) in crd_schemas:
            custom = crd_schemas[(group, obj["kind"])]
            schema = custom["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            jsonschema.Draft4Validator(schema).validate(obj)  # OpenAPI 3.0: draft 4 bounds
            namespaced = custom["spec"]["scope"] == "Namespaced"
            assert ("namespace" in obj["metadata"]) == namespaced, obj["metadata"]
        elif group == "monitoring.coreos.com":
            jsonschema.validate(obj, MONITOR_SUBSETS[obj["kind"]])
        else:
            for kube in KUBE_VERSIONS:
                kubernetes_validate.validate(obj, kube, strict=True)


# The chart's only resources whose CRDs it does not ship (the Prometheus Operator's): subsets
# of monitoring.coreos.com/v1 ServiceMonitor's and PodMonitor's schemas, transcribed from its
# CRDs (example/prometheus-operator-crd/, operator 0.93: the duration pattern, the
# namespaceSelector's two forms, a relabeling's fields and actions) and closed over the fields
# the chart writes, so a misspelt or misplaced field fails here rather than being pruned by the
# server. Stricter than the CRDs in two places, on purpose: the endpoints are required (without
# them nothing is scraped) and sourceLabels must be Prometheus 2.x label names (older CRDs had
# that pattern; Prometheus 2.x still refuses other names).
DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
RELABEL_ACTIONS = ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep"]
RELABEL_ACTIONS += ["lowercase", "uppercase", "keepequal", "dropequal"]


def _closed(properties: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": properties}


def monitor_subset(kind: str, endpoints: str) -> dict:
    """The schema subset of a ServiceMonitor (``endpoints``) or PodMonitor
    (``podMetricsEndpoints``): the same selector, namespaces and endpoint fields."""
    string, strings = {"type": "string"}, {"type": "array", "items": {"type": "string"}}
    duration = {"type": "string", "pattern": DURATION}
    relabeling = _closed({
        "action": {"enum": RELABEL_ACTIONS + [a.capitalize() for a in RELABEL_ACTIONS]},
        "sourceLabels": {"type": "array",
                         "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "targetLabel": string, "regex": string, "replacement": string, "separator": string,
    })  # fmt: skip
    endpoint = _closed({"port": string, "path": string, "interval": duration,
                        "scrapeTimeout": duration,
                        "relabelings": {"type": "array", "items": relabeling}})  # fmt: skip
    spec = _closed({
        "selector": _closed({"matchLabels": {"type": "object", "additionalProperties": string}}),
        "namespaceSelector": _closed({"any": {"type": "boolean"}, "matchNames": strings}),
        endpoints: {"type": "array", "minItems": 1, "items": endpoint},
    })  # fmt: skip
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": spec | {"required": ["selector", endpoints]},
        },
    }


MONITOR_SUBSETS = {
    "ServiceMonitor": monitor_subset("ServiceMonitor", "endpoints"),
    "PodMonitor": monitor_subset("PodMonitor", "podMetricsEndpoints"),
}


def chart_crds() -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        return [d for c in chart.crds for d in yaml.safe_load_all(c["data"]) if d]


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_chart_crds_are_valid_kubernetes(kube):
    kinds = sorted(c["spec"]["names"]["kind"] for c in chart_crds())
    assert kinds == ["ClusterKopfPeering", "FineTuneJob", "FineTuneProfile", "KopfPeering"]
    for c in chart_crds():
        kubernetes_validate.validate(c, kube, strict=True)


def test_chart_crd_equals_generator():
    copy = CHART / "crds" / f"{jobspec.PLURAL}.{jobspec.GROUP}.yaml"
    assert copy.read_text() == crd.render_yaml(), "regenerate: python scripts/manifests.py"


def test_chart_version_is_ftjobs_and_so_is_the_image_tag(rendered):
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["appVersion"] == __version__
    image = the(rendered["defaults"], "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert image["image"] == f"ghcr.io/ftjob/operator:{__version__}"
    assert jobspec.DEFAULT_IMAGE.endswith(
        f":{__version__}"
    )  # the trainer image of the same release


# -- values --------------------------------------------------------------------------------


def test_every_value_in_values_yaml_has_a_comment():
    """Each leaf is documented by a comment on itself or on one of its parents."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented: dict[tuple[int, str], bool] = {}
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented)
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z][\w-]*):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        has_comment = i > 0 and lines[i - 1].strip().startswith("#") or "#" in rest
        inherited = any(d for _, _, d in stack)
        stack.append((indent, key, has_comment or inherited))
        documented[(i, key)] = has_comment or inherited
        is_leaf = rest.strip() != "" or not (
            i + 1 < len(lines) and re.match(rf"^ {{{indent + 1},}}\S", lines[i + 1])
        )
        if is_leaf and not (has_comment or inherited):
            undocumented.append(".".join(k for _, k, _ in stack))
    assert len(documented) >= 30
    assert undocumented == []


def test_schema_and_values_agree():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        schema = chart.schema
    assert set(schema["properties"]) - {"global"} == set(values)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"replicaCount": 2}, "/peering/enabled"),  # two operators acting at once
        ({"peering": {"enabled": True, "lifetime": 5}}, "/peering/lifetime"),  # lapses
        ({"watchNamespaces": ["Team_A"]}, "/watchNamespaces/0"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"metrics": {"port": 80}}, "/metrics/port"),  # the pod runs non-root: no port < 1024
        ({"replicas": 2}, "replicas"),  # unknown key: a typo is refused, not ignored
        ({"trainer": {"defaultImage": "my trainer:1"}}, "/trainer/defaultImage"),
        ({"trainer": {"podMonitor": {"interval": "30"}}}, "/trainer/podMonitor/interval"),
        ({"trainer": {"podMonitor": {"port": 8000}}}, "port"),  # the pods' port is named
        ({"dashboard": {"label": "grafana dashboard"}}, "/dashboard/label"),
        ({"dashboard": {"labelValue": 1}}, "/dashboard/labelValue"),
        ({"profile": {"spec": {"limits": {"maxNodes": 0}}}}, "/profile/spec/limits/maxNodes"),
        ({"profile": {"spec": {"default": {}}}}, "default"),  # a typo of defaults
    ],
)
def test_schema_refuses_bad_values(values, message):
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        render(values)


def test_template_refuses_replicas_without_peering_even_without_the_schema(tmp_path):
    """`helm install --skip-schema-validation` still cannot start two acting operators."""
    chart = tmp_path / "ftjob"
    shutil.copytree(CHART, chart)
    (chart / "values.schema.json").unlink()
    with helm.Chart.load(str(chart)) as loaded:
        loaded.render({"peering": {"enabled": True}, "replicaCount": 2}, name="x", namespace="y")
        with pytest.raises(helm.HelmRenderError, match="needs peering.enabled=true"):
            loaded.render({"replicaCount": 2}, name="x", namespace="y")


# -- the operator's Deployment -------------------------------------------------------------


def operator_parser():
    import argparse

    parser = argparse.ArgumentParser(prog="ftjob", exit_on_error=False)
    sub = parser.add_subparsers(dest="command", required=True)
    add_arguments(sub.add_parser("operator", exit_on_error=False))
    return parser


@pytest.mark.parametrize("combo", COMBOS)
def test_operator_args_parse_with_the_operators_own_flags(combo, rendered):
    values = COMBOS[combo]
    pod = the(rendered[combo], "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = operator_parser().parse_args(container["args"])
    watch = values.get("watchNamespaces", [])
    assert args.all_namespaces == (not watch) and args.namespace == watch
    peering = values.get("peering", {}).get("enabled", False)
    assert args.standalone == (not peering)
    assert args.peering == (values["peering"].get("name", "ftjob") if peering else None)
    assert args.peering_lifetime == (values["peering"].get("lifetime", 60) if peering else None)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.liveness == f"http://0.0.0.0:{ports['health']}/healthz"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    metrics_on = values.get("metrics", {}).get("enabled", True)
    assert args.metrics_port == (ports["metrics"] if metrics_on else 0)
    assert ("metrics" in ports) == metrics_on
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_operator_pod_meets_the_restricted_pod_security_standard(rendered):
    for combo, objs in rendered.items():
        pod = the(objs, "Deployment")["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        sc, csc = pod["securityContext"], container["securityContext"]
        assert sc["runAsNonRoot"] and sc["runAsUser"] > 0, combo
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"] == {"drop": ["ALL"]}
        assert csc["readOnlyRootFilesystem"] is True
        assert not pod.get("hostNetwork") and not pod.get("hostPID")
        assert all(p["containerPort"] >= 1024 for p in container["ports"])
        assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


def test_single_operator_is_recreated_replicas_roll(rendered):
    assert the(rendered["defaults"], "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    ha = the(rendered["ha-peering"], "Deployment")["spec"]
    assert ha["replicas"] == 2 and ha["strategy"]["type"] == "RollingUpdate"


def test_values_reach_the_pod(rendered):
    values = COMBOS["private-registry-gpu-cluster"]
    pod = the(rendered["private-registry-gpu-cluster"], "Deployment")["spec"]["template"]
    spec_ = pod["spec"]
    assert spec_["containers"][0]["image"] == "registry.example.com/ml/ftjob-operator:0.1.0-rc1"
    for key in ("imagePullSecrets", "nodeSelector", "tolerations", "affinity"):
        assert spec_[key] == values[key], key
    assert spec_["priorityClassName"] == values["priorityClassName"]
    assert spec_["serviceAccountName"] == "ftjob-operator"
    assert pod["metadata"]["labels"]["team"] == "ml-platform"
    assert spec_["containers"][0]["args"][-1] == "--verbose"
    assert spec_["containers"][0]["resources"] == values["resources"]


def test_trainer_default_image_reaches_the_operator_and_its_pods(rendered):
    """trainer.defaultImage becomes the operator's FTJOB_DEFAULT_IMAGE, which its settings
    read and its render puts into the pods of a job without spec.image; unset, the variable
    is empty (there for `kubectl set env`) and the pods get the placeholder."""
    from ftjob.api import manifest
    from ftjob.operator import handlers, render
    from ftjob.operator.admit import parse_job

    (job,) = manifest.load(ROOT / "examples" / "llama3-8b-lora-efa.yaml")
    _, job_spec = parse_job(job)
    assert job_spec.image is None
    for combo, want in [
        ("private-registry-gpu-cluster", "registry.example.com/ml/ftjob-trainer:0.1.0-efa"),
        ("defaults", jobspec.DEFAULT_IMAGE),
    ]:
        container = the(rendered[combo], "Deployment")["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in container["containers"][0]["env"]}
        settings = handlers.Settings.from_env(env)
        pod = render.pod("j", "ns", job_spec, 0, 0, "u" * 36, settings.default_image)
        assert pod["spec"]["containers"][0]["image"] == want, combo


def test_metrics_service_selects_only_the_operator(rendered):
    objs = rendered["monitoring"]
    service = the(objs, "Service")
    deploy = the(objs, "Deployment")
    selector = service["spec"]["selector"]
    assert selector == deploy["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/component"] == "operator"  # trainer pods lack it
    assert service["spec"]["ports"][0]["port"] == 9400
    monitor = the(objs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == selector
    assert selector.items() <= service["metadata"]["labels"].items()  # it finds the Service
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert [o["kind"] for o in rendered["defaults"] if o["kind"] == "ServiceMonitor"] == []
    assert not [o for o in rendered["no-metrics-own-rbac"] if o["kind"] in ("Service",)]


# -- the trainer pods' PodMonitor and the Grafana dashboard ---------------------------------


def matches(selector: dict, labels: dict) -> bool:
    return selector["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize(
    "combo", ["prometheus-operator-and-grafana", "monitors-in-watched-namespaces"]
)
def test_pod_monitor_scrapes_rank_0_of_every_job_where_the_operator_watches(combo, rendered):
    """The PodMonitor against the pods the operator's own render builds: rank 0 of a job is
    selected, on the container port that serves /metrics (spec.network.progressPort, here
    not the default), rank 1 and the operator's own pod are not; it looks in the namespaces
    the operator's arguments name."""
    from ftjob.api import manifest
    from ftjob.operator import render
    from ftjob.operator.admit import parse_job

    objs = rendered[combo]
    monitor = the(objs, "PodMonitor")["spec"]
    (doc,) = manifest.load(ROOT / "examples" / "llama3-8b-lora-efa.yaml")  # two nodes
    doc["spec"]["network"]["progressPort"] = 8123
    _, job_spec = parse_job(doc)
    rank0, rank1 = (render.pod("demo", "team-a", job_spec, r, 2, "u" * 36) for r in (0, 1))
    assert matches(monitor["selector"], rank0["metadata"]["labels"])
    assert not matches(monitor["selector"], rank1["metadata"]["labels"])
    operator_pod = the(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not matches(monitor["selector"], operator_pod)
    (endpoint,) = monitor["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in rank0["spec"]["containers"][0]["ports"]}
    assert ports[endpoint["port"]] == 8123 and endpoint["path"] == "/metrics"
    # The job's name becomes a label of every series, read from the pod's job-name label
    # (Prometheus' meta label: the label's name with every other character made "_").
    (relabel,) = endpoint["relabelings"]
    meta = "__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", render.LABEL_JOB)
    assert relabel == {"sourceLabels": [meta], "targetLabel": "ftjob_job"}
    assert rank0["metadata"]["labels"][render.LABEL_JOB] == "demo"
    args = operator_parser().parse_args(
        the(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    if args.all_namespaces:
        assert monitor["namespaceSelector"] == {"any": True}
    else:
        assert monitor["namespaceSelector"] == {"matchNames": args.namespace}


def test_monitors_and_dashboard_are_off_by_default(rendered):
    for combo in ("defaults", "monitoring", "namespaced"):
        kinds = [o["kind"] for o in rendered[combo]]
        assert "PodMonitor" not in kinds, combo
        assert "ConfigMap" not in kinds, combo  # the dashboard is the chart's only ConfigMap
    assert "ServiceMonitor" not in [o["kind"] for o in rendered["defaults"]]


def dashboard_file() -> dict:
    return json.loads((CHART / "dashboards" / "ftjob.json").read_text())


def test_dashboard_configmap_carries_the_sidecar_label_and_the_file(rendered):
    default = the(rendered["prometheus-operator-and-grafana"], "ConfigMap")
    assert default["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert default["metadata"]["namespace"] == NAMESPACE
    assert default["metadata"]["annotations"] == {"grafana_folder": "ML"}
    assert json.loads(default["data"]["ftjob.json"]) == dashboard_file()
    custom = the(rendered["monitors-in-watched-namespaces"], "ConfigMap")
    assert custom["metadata"]["labels"]["example.com/grafana-dashboard"] == "ftjob"
    assert "grafana_dashboard" not in custom["metadata"]["labels"]
    assert custom["metadata"]["namespace"] == "monitoring"


def panels_of(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out += [p, *p.get("panels", [])]
    return out


def test_dashboard_has_the_panels_and_every_query_uses_the_chosen_prometheus():
    dashboard = dashboard_file()
    panels = panels_of(dashboard)
    titles = {p["title"] for p in panels}
    wanted = {"Jobs by phase", "Loss", "Tokens/s", "MFU", "Restarts", "Reconcile latency"}
    assert wanted | {"Stragglers", "Preflight bus bandwidth"} <= titles
    assert len({p["id"] for p in panels}) == len(panels)  # Grafana keys panels by id
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    graphs = [p for p in panels if p["type"] != "row"]
    for panel in graphs:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            for var in re.findall(r"\$(\w+)", target["expr"]):
                assert var in variables or var.startswith("__"), (panel["title"], var)
    # Panels tile the grid: none overlaps another.
    cells = set()
    for panel in panels:
        g = panel["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine and g["x"] + g["w"] <= 24, panel["title"]
        cells |= mine


def test_dashboard_query_reader_finds_metric_names():
    """tests/dashboard_queries.py's tokenizer: functions, aggregations, label lists, label
    matchers, ranges and Grafana variables are not metric names; a misspelt name is
    reported against the operator's real exposition."""
    from dashboard_queries import exported_series, metric_names, unexported

    from ftjob.operator import metrics

    expr = (
        'histogram_quantile(0.99, sum by (le, operation) (rate(a_bucket{x="}", y=~"$v"}'
        "[$__rate_interval] offset 1h))) / on (job) group_left (node) b * 2 > bool 1e3"
        " and ignoring (z) max without (w) (c)"
    )
    assert metric_names(expr) == {"a_bucket", "b", "c"}
    assert metric_names('label_values(ftjob_step{namespace=~"$ns"}, ftjob_job)') == {"ftjob_step"}
    exported = exported_series(metrics.text().decode())
    assert {"ftjob_reconcile_seconds_bucket", "ftjob_gang_restarts_total"} <= exported
    assert "ftjob_gang_restarts" not in exported  # Prometheus stores the counter as _total
    typo = {"panels": [{"targets": [{"expr": "sum(rate(ftjob_reconcile_error_total[5m]))"}]}]}
    assert unexported(typo, exported) == {
        "ftjob_reconcile_error_total": ["sum(rate(ftjob_reconcile_error_total[5m]))"]
    }


def test_the_operator_and_the_trainer_share_no_metric_name():
    """One Prometheus scrapes both (their real registries here): a name both exported would
    mix the operator's by-job series into the trainer panels, or merge a counter's and a
    gauge's metadata."""
    from dashboard_queries import exported_series, families

    from ftjob.operator import metrics as operator_metrics
    from ftjob.trainer.report import metrics as trainer_metrics

    # Every gauge the trainer can export is on its page only with a value.
    snapshot = {key: 1.0 for _, key, _ in trainer_metrics.GAUGES} | {"phase": "training"}
    snapshot["stragglers"] = [{"rank": 3, "node": "n", "stepSeconds": 2.0}]
    trainer = trainer_metrics.TrainerMetrics(lambda: snapshot).text().decode()
    assert {name for name, _, _ in trainer_metrics.GAUGES} <= families(trainer)
    operator = operator_metrics.text().decode()
    assert families(operator) & families(trainer) == set()
    assert exported_series(operator) & exported_series(trainer) == set()


def test_the_operator_s_by_job_gauges_name_the_job_with_labels_of_their_own():
    """Not ``namespace`` and ``job``: Prometheus sets those on every series it scrapes (the
    target's), and would keep the operator's only as ``exported_namespace``/``exported_job``."""
    from prometheus_client.parser import text_string_to_metric_families

    from ftjob.operator import metrics

    def samples() -> dict:
        page = metrics.text().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(page)
            for s in family.samples
        }

    slow = {"rank": 1, "node": "b", "stepSeconds": 2.0, "medianSeconds": 1.0}
    status = {"stragglers": [slow], "preflight": {"busBandwidthGBps": 12.5, "nodes": 2}}
    metrics.observed("team-a", "llama", {}, status)
    try:
        job = (("ftjob_job", "llama"), ("ftjob_namespace", "team-a"))
        assert samples()[("ftjob_job_stragglers", job)] == 1
        assert samples()[("ftjob_preflight_bus_bandwidth_gbps", job)] == 12.5
        metrics.observed("team-a", "llama", status, status | {"stragglers": []})
        assert samples()[("ftjob_job_stragglers", job)] == 0
        target = {"namespace", "job", "pod", "instance", "service", "endpoint", "container"}
        assert not {name for _, labels in samples() for name, _ in labels} & target
    finally:
        metrics.forget("team-a", "llama")
    assert not [key for key in samples() if ("ftjob_job", "llama") in key[1]]


def test_notes_tell_the_next_command():
    notes = render({})["ftjob/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} rollout status deployment/ftjob" in notes
    assert "kubectl get finetunejobs" in notes
    namespaced = render(COMBOS["namespaced"])["ftjob/templates/NOTES.txt"]
    assert "team-a, team-b" in namespaced
    assert "Monitoring" not in notes
    monitored = render(COMBOS["monitors-in-watched-namespaces"])["ftjob/templates/NOTES.txt"]
    assert f"PodMonitor {NAMESPACE}/ftjob-trainers" in monitored
    assert "ConfigMap monitoring/ftjob-dashboard" in monitored
    assert "label example.com/grafana-dashboard=ftjob" in monitored
    dashboard = dashboard_file()
    assert f'"{dashboard["title"]}" (uid {dashboard["uid"]})' in monitored


# -- RBAC: exactly what the code uses -------------------------------------------------------

CLUSTER_SCOPED = {
    ("apiextensions.k8s.io", "customresourcedefinitions"),
    ("kopf.dev", "clusterkopfpeerings"),
    ("", "namespaces"),
    (jobspec.GROUP, "finetuneprofiles"),
}
KUBE_METHOD = re.compile(
    r"^(?P<verb>create|delete|get|list|patch|read|replace)_(?P<scope>namespaced_|cluster_)?"
    r"(?P<kind>[a-z_]+?)(?P<sub>_status)?$"
)
VERB = {"create": "create", "delete": "delete", "list": "list", "patch": "patch"}
VERB |= {"get": "get", "read": "get", "replace": "update"}
HANDLERS_THAT_PATCH = {"daemon", "timer", "create", "update", "delete", "resume", "field"}
HANDLERS_THAT_WATCH = HANDLERS_THAT_PATCH | {"index", "event"}


def _constant(node: ast.expr) -> str:
    """A string literal, or a name imported from ftjob.api.jobspec (GROUP, PLURAL, ...) or, as
    kube.py names it, ftjob.api.profile's PLURAL (PROFILES)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id == "PROFILES":
        return profile.PLURAL
    if isinstance(node, ast.Name) and hasattr(jobspec, node.id):
        return getattr(jobspec, node.id)
    raise AssertionError(f"cannot resolve {ast.unparse(node)} at line {node.lineno}")


def kube_py_permissions() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every API call in kube.py.

    Calls are methods of the kubernetes client's CoreV1Api (``self.core``) and
    CustomObjectsApi (``self.custom``), named directly or through
    ``getattr(self.core, f"create_namespaced_{_KINDS[...]}")``. Anything else fails the
    test, so a new kind of call cannot slip past the RBAC rules.
    """
    tree = ast.parse(KUBE_PY.read_text())
    kinds: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["_KINDS"]:
            kinds = ast.literal_eval(node.value)
    calls: list[tuple[str, str, ast.Call | None]] = []  # (api, method, call)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    apis = ("self.core", "self.custom")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in apis:
            parent = parents.get(node)
            called = isinstance(parent, ast.Call) and parent.func is node
            calls.append((node.value.attr, node.attr, parent if called else None))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr":
            api, name = node.args
            assert isinstance(name, ast.JoinedStr), ast.unparse(node)
            prefix = name.values[0].value
            assert ast.unparse(name.values[1].value).startswith("_KINDS["), ast.unparse(node)
            calls += [(api.attr, prefix + kind, None) for kind in kinds.values()]
    perms = set()
    for api, method, call in calls:
        if method == "get_api_resources":
            continue  # discovery: every authenticated user may (system:discovery)
        m = KUBE_METHOD.match(method)
        assert m, f"kube.py calls {api}.{method}: teach this test its RBAC verb and resource"
        verb, kind, sub = VERB[m["verb"]], m["kind"], m["sub"] or ""
        if call is None and verb == "list" and "watch.Watch" in KUBE_PY.read_text():
            verb = "watch"  # a list method handed to watch.Watch().stream (list is added too)
        if api == "core":
            group, resource = "", kind.replace("_", "") + "s"
        else:
            assert kind == "custom_object" and call is not None, method
            plural = 2 if m["scope"] == "cluster_" else 3  # (group, version, [namespace,] plural)
            group, resource = _constant(call.args[0]), _constant(call.args[plural])
        perms.add((group, resource + sub.replace("_", "/"), verb))
        if verb == "watch":
            perms.add((group, resource + sub.replace("_", "/"), "list"))
    return perms


def kopf_permissions() -> set[tuple[str, str, str]]:
    """What kopf itself does for the handlers registered in handlers.py."""
    tree = ast.parse(HANDLERS_PY.read_text())
    source = HANDLERS_PY.read_text()
    perms = set()
    decorators = [
        d
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for d in f.decorator_list
        if isinstance(d, ast.Call)
    ]
    for node in decorators:
        func = ast.unparse(node.func)
        if not func.startswith("kopf.") or not node.args:
            continue
        kind = func.rpartition(".")[2]
        if kind not in HANDLERS_THAT_WATCH:
            continue
        names = [_constant(a) for a in node.args]
        if len(names) == 3:  # kopf.daemon(GROUP, VERSION, PLURAL)
            group, resource = names[0], names[2]
        elif len(names) == 2:  # kopf.on.event("v1", "pods") or (group, plural)
            group, resource = ("" if names[0] == "v1" else names[0].partition("/")[0]), names[1]
        elif "." in names[0]:  # kopf.on.event("finetunejobs.ftjob.dev")
            resource, _, group = names[0].partition(".")
        else:  # kopf.index("pods"): a core resource by its plural
            group, resource = "", names[0]
        perms |= {(group, resource, "list"), (group, resource, "watch")}
        if kind in HANDLERS_THAT_PATCH:
            # finalizers (daemons/timers are stopped before deletion) and kopf's
            # progress/diff-base annotations
            perms.add((group, resource, "patch"))
    if re.search(r"persistence\.finalizer\s*=", source):
        # A finalizer no handler needs: kopf takes it off every job it sees that carries it
        # (jobs from before an upgrade, when per-job daemons set it). Only jobs ever had it.
        perms.add((jobspec.GROUP, jobspec.PLURAL, "patch"))
    posts = re.search(r"kopf\.(event|info|warn|exception)\(", source)
    posting_off = re.search(r"settings\.posting\.enabled\s*=\s*False", source)
    if posts or not posting_off:  # kopf also posts its own log records as Events
        perms.add(("", "events", "create"))
    if not re.search(r"settings\.scanning\.disabled\s*=\s*True", source):
        # kopf watches CRDs to notice the resource's CRD appearing or going away
        perms |= {
            ("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")
        }
    return perms


def expected_rules(values: dict) -> set[tuple]:
    """(scope, apiGroup, resource, verb, resourceName) the chart must grant, no more."""
    needs = {(g, r, v, None) for g, r, v in kube_py_permissions() | kopf_permissions()}
    if owner_reference("job", "uid").get("blockOwnerDeletion"):
        # OwnerReferencesPermissionEnforcement: a child blocking its owner's deletion needs
        # update on the owner's finalizers (the real API server refuses it otherwise).
        needs.add(("ftjob.dev", "finetunejobs/finalizers", "update", None))
    watch = values.get("watchNamespaces", [])
    peering = values.get("peering", {})
    if peering.get("enabled"):
        name = peering.get("name", "ftjob")
        plural = "kopfpeerings" if watch else "clusterkopfpeerings"
        needs |= {("kopf.dev", plural, "list", None), ("kopf.dev", plural, "watch", None)}
        needs.add(("kopf.dev", plural, "patch", name))  # keep-alives: only our peering object
    out = set()
    for g, r, v, n in needs:
        if not watch or (g, r) in CLUSTER_SCOPED:
            out.add(("cluster", g, r, v, n))
        else:
            out |= {(ns, g, r, v, n) for ns in watch}
    return out


def granted_rules(objs: list[dict], sa: str) -> set[tuple]:
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objs}
    out = set()
    for o in objs:
        if o["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        assert o["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
        ns = o["metadata"].get("namespace")
        role = roles[
            (
                o["roleRef"]["kind"],
                ns if o["roleRef"]["kind"] == "Role" else None,
                o["roleRef"]["name"],
            )
        ]
        scope = ns or "cluster"
        for rule in role["rules"]:
            assert not rule.get("nonResourceURLs")
            names = rule.get("resourceNames") or [None]
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    for v in rule["verbs"]:
                        assert "*" not in (g, r, v), rule
                        out |= {(scope, g, r, v, n) for n in names}
    return out


def test_code_reading_finds_the_operators_calls():
    """The readers above see what the operator does today (guards the readers themselves)."""
    kube = kube_py_permissions()
    assert ("", "pods", "create") in kube and ("", "pods", "delete") in kube
    assert (jobspec.GROUP, f"{jobspec.PLURAL}/status", "patch") in kube
    kopf_ = kopf_permissions()
    assert {(jobspec.GROUP, jobspec.PLURAL, "watch"), ("", "pods", "watch")} <= kopf_


@pytest.mark.parametrize(
    "combo", [c for c in COMBOS if COMBOS[c].get("rbac", {}).get("create", True)]
)
def test_rbac_grants_exactly_what_the_operator_uses(combo, rendered):
    values = COMBOS[combo]
    sa = values.get("serviceAccount", {}).get("name") or values.get("fullnameOverride", "ftjob")
    granted = granted_rules(rendered[combo], sa)
    expected = expected_rules(values)
    assert granted - expected == set(), "granted but never used"
    assert expected - granted == set(), "used but not granted"


def test_namespaced_mode_has_no_cluster_access_to_namespaced_resources(rendered):
    cluster = [o for o in rendered["namespaced"] if o["kind"] == "ClusterRole"]
    resources = {r for o in cluster for rule in o["rules"] for r in rule["resources"]}
    # Cluster-scoped all: the CRDs' watch, the profiles and the namespaces' labels.
    assert resources == {"customresourcedefinitions", "finetuneprofiles", "namespaces"}
    roles = [o for o in rendered["namespaced"] if o["kind"] == "Role"]
    assert sorted(o["metadata"]["namespace"] for o in roles) == ["team-a", "team-b"]


def test_the_chart_installs_the_profile_of_its_values_and_none_by_default(rendered):
    made = the(rendered["default-profile"], "FineTuneProfile")
    want = parse_profile(
        yaml.safe_load((ROOT / "examples" / "profiles" / "team-a.yaml").read_text())
    )
    assert parse_profile(made) == want  # the same profile as the file: name, spec
    assert made["metadata"]["labels"]["app.kubernetes.io/part-of"] == "ftjob"
    assert not [o for o in rendered["defaults"] if o["kind"] == "FineTuneProfile"]


def test_rbac_create_false_renders_no_rbac(rendered):
    kinds = {o["kind"] for o in rendered["no-metrics-own-rbac"]}
    assert not kinds & {
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ServiceAccount",
    }
    pod = the(rendered["no-metrics-own-rbac"], "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "platform-operator"


def test_peering_objects_exist_where_the_operator_looks(rendered):
    cluster = [o for o in rendered["ha-peering"] if o["kind"] == "ClusterKopfPeering"]
    assert [o["metadata"]["name"] for o in cluster] == ["ftjob-ha"]
    spaced = [o for o in rendered["ha-namespaced"] if o["kind"] == "KopfPeering"]
    assert [(o["metadata"]["namespace"], o["metadata"]["name"]) for o in spaced] == [
        ("team-a", "ftjob")
    ]
    assert not [o for o in rendered["defaults"] if "KopfPeering" in o["kind"]]


# -- manifests/ ----------------------------------------------------------------------------


def generator():
    loaded = importlib.util.spec_from_file_location(
        "manifests_gen", ROOT / "scripts" / "manifests.py"
    )
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def test_install_yaml_is_the_charts_default_render():
    gen = generator()
    assert (ROOT / "manifests" / "install.yaml").read_text() == gen.install_yaml(), (
        "regenerate: python scripts/manifests.py"
    )


def test_install_yaml_holds_crds_namespace_and_operator():
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "install.yaml").read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds[:2] == ["Namespace", "CustomResourceDefinition"]
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service", "Deployment"} <= set(
        kinds
    )
    assert kinds.index("CustomResourceDefinition") < kinds.index("Deployment")
    namespace = docs[0]
    for kube in KUBE_VERSIONS:
        kubernetes_validate.validate(namespace, kube, strict=True)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert all(d["metadata"].get("namespace", NAMESPACE) == NAMESPACE for d in docs)
    ftj = next(d for d in docs if d["metadata"]["name"] == f"{jobspec.PLURAL}.{jobspec.GROUP}")
    assert ftj == crd.crd()


def test_samples_are_the_examples():
    gen = generator()
    assert gen.stale() == [], "regenerate: python scripts/manifests.py"
    names = sorted(p.name for p in (ROOT / "manifests" / "samples").glob("*.yaml"))
    assert names == sorted(p.name for p in (ROOT / "examples").glob("*.yaml")) and names


def test_docs_name_real_files_and_their_helm_commands_render():
    """Every repository path docs/install.md names exists; every `helm install/upgrade` it
    shows renders with its --set values (so a renamed value breaks this test, not a user)."""
    text = (ROOT / "docs" / "install.md").read_text()
    paths = set(re.findall(r"(?:manifests|charts|examples|scripts)/[\w./-]+\.(?:ya?ml|py)", text))
    paths |= set(re.findall(r"\bcharts/ftjob(?:/crds)?/?", text))
    assert len(paths) >= 6
    assert [p for p in paths if not (ROOT / p).exists()] == []
    commands = re.findall(r"^(helm (?:install|upgrade) (?:.*\\\n)*.*)$", text, flags=re.MULTILINE)
    assert len(commands) >= 3
    for command in commands:
        args = shlex.split(command.replace("\\\n", " "))
        assert args[3] == "charts/ftjob", command
        values: dict = {}
        for i, arg in enumerate(args):
            if args[i - 1] == "--set":
                merge(values, helm.parse_set_string(arg))
        render(values)  # refused if a key is unknown or a value has the wrong type


def merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def test_docs_monitoring_values_file_renders_the_monitors_and_the_dashboard():
    """docs/install.md's "Prometheus Operator and Grafana" values file, as a user pastes it."""
    text = (ROOT / "docs" / "install.md").read_text()
    section = text.split("### Prometheus Operator and Grafana", 1)[1].split("\n#", 1)[0]
    values = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1))
    kinds = [o["kind"] for o in objects(values)]
    assert {"ServiceMonitor", "PodMonitor", "ConfigMap"} <= set(kinds)


def test_the_operators_start_up_checks_what_the_chart_grants():
    """ftjob.operator.startup.NEEDED (asked of the authorizer before anything is reconciled,
    so a missing rule ends the operator naming it) is the chart's cluster-wide rules."""
    granted = {(g, r, v) for _, g, r, v, _ in expected_rules({})}
    assert set(startup.NEEDED) == granted
    needed = {(g, r) for g, r, _ in startup.NEEDED}
    assert {r for _, r in needed if r in startup.CLUSTER_SCOPED} == {
        r for g, r in CLUSTER_SCOPED if (g, r) in needed
    }
