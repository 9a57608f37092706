"""The emulator behaves like an API server where the operator depends on it (FINDINGS' gaps),
checked through the official kubernetes client over HTTP."""

import json

import pytest
from kubernetes import client, config
from support import tiny_job

FTJ = ("ftjob.dev", "v1alpha1")


@pytest.fixture(scope="module")
def api(cluster):
    api_client = config.new_client_from_config(str(cluster.kubeconfig))
    return client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)


def raw(response) -> dict:
    return json.loads(response.data)


def cm(name=None, labels=None, **meta):
    metadata = {"labels": labels or {}, **meta} | ({"name": name} if name else {})
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {"a": "1"}}


def test_server_sets_identity_fields_and_resolves_generate_name(api):
    core, _ = api
    made = raw(
        core.create_namespaced_config_map("ns1", cm(generateName="x-"), _preload_content=False)
    )
    meta = made["metadata"]
    assert meta["name"].startswith("x-") and len(meta["name"]) > 2
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
    assert meta["namespace"] == "ns1" and made["kind"] == "ConfigMap" and made["apiVersion"] == "v1"
    with pytest.raises(client.ApiException) as e:
        core.create_namespaced_config_map("ns1", cm(meta["name"]), _preload_content=False)
    assert e.value.status == 409


def test_label_selectors_filter_lists(api):
    core, _ = api
    for name, labels in [("a", {"app": "x", "tier": "1"}), ("b", {"app": "y"}), ("c", {})]:
        core.create_namespaced_config_map("sel", cm(name, labels), _preload_content=False)

    def names(selector):
        listing = core.list_namespaced_config_map(
            "sel", label_selector=selector, _preload_content=False
        )
        return [i["metadata"]["name"] for i in raw(listing)["items"]]

    assert names("app=x") == ["a"]
    assert names("app") == ["a", "b"] and names("!app") == ["c"]
    assert names("app in (x,y),tier!=2") == ["a", "b"] and names("app notin (x)") == ["b", "c"]


def test_status_is_isolated_and_generation_follows_the_spec(api, cluster):
    _, custom = api
    cluster.create_job(tiny_job("iso"))
    body = {"spec": {"image": "other:1"}, "status": {"phase": "Running"}}
    merge = "application/merge-patch+json"
    obj = custom.patch_namespaced_custom_object(
        *FTJ, "default", "finetunejobs", "iso", body, _content_type=merge
    )
    assert obj["spec"]["image"] == "other:1" and "status" not in obj
    assert obj["metadata"]["generation"] == 2
    obj = custom.patch_namespaced_custom_object_status(
        *FTJ,
        "default",
        "finetunejobs",
        "iso",
        {"spec": {"image": "x:2"}, **body},
        _content_type=merge,
    )
    assert obj["status"] == {"phase": "Running"} and obj["spec"]["image"] == "other:1"
    assert obj["metadata"]["generation"] == 2  # a status write is not a new generation


def test_failed_json_patch_test_answers_422(api, cluster):
    _, custom = api
    cluster.create_job(tiny_job("jp"))
    ops = [
        {"op": "test", "path": "/spec/image", "value": "nope"},
        {"op": "replace", "path": "/spec/image", "value": "x:1"},
    ]
    with pytest.raises(client.ApiException) as e:
        custom.patch_namespaced_custom_object(
            *FTJ, "default", "finetunejobs", "jp", ops, _content_type="application/json-patch+json"
        )
    assert e.value.status == 422
    assert cluster.get("finetunejobs", "jp")["spec"].get("image") != "x:1"


def test_crd_schema_and_cel_rules_are_enforced_with_defaults(api, cluster):
    _, custom = api
    bad = tiny_job("bad", parallelism={"sharding": "hybrid"}, resources={"nodes": 1})
    with pytest.raises(client.ApiException) as e:
        custom.create_namespaced_custom_object(*FTJ, "default", "finetunejobs", bad)
    assert e.value.status == 422 and "hybrid sharding needs resources.nodes" in e.value.body
    made = custom.create_namespaced_custom_object(*FTJ, "default", "finetunejobs", tiny_job("ok"))
    assert made["spec"]["runPolicy"]["backoffLimit"] == 3  # defaulted by the schema
    with pytest.raises(client.ApiException) as e:  # an immutable field (CEL transition rule)
        custom.patch_namespaced_custom_object(
            *FTJ,
            "default",
            "finetunejobs",
            "ok",
            {"spec": {"training": {"maxSteps": 7}}},
            _content_type="application/merge-patch+json",
        )
    assert e.value.status == 422


def test_deleting_an_owner_collects_what_it_owns(api, cluster):
    core, custom = api
    owner = cluster.create_job(tiny_job("owner"))
    ref = {
        "apiVersion": "ftjob.dev/v1alpha1",
        "kind": "FineTuneJob",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    core.create_namespaced_config_map(
        "default", cm("owned", ownerReferences=[ref]), _preload_content=False
    )
    core.create_namespaced_config_map("default", cm("free"), _preload_content=False)
    custom.delete_namespaced_custom_object(*FTJ, "default", "finetunejobs", "owner")
    assert cluster.get("configmaps", "owned") is None
    assert cluster.get("configmaps", "free") is not None


def test_finalizers_hold_deletion_until_removed(api, cluster):
    _, custom = api
    doc = tiny_job("held")
    doc["metadata"]["finalizers"] = ["ftjob.dev/test"]
    cluster.create_job(doc)
    custom.delete_namespaced_custom_object(*FTJ, "default", "finetunejobs", "held")
    assert cluster.get("finetunejobs", "held")["metadata"]["deletionTimestamp"]
    custom.patch_namespaced_custom_object(
        *FTJ,
        "default",
        "finetunejobs",
        "held",
        {"metadata": {"finalizers": None}},
        _content_type="application/merge-patch+json",
    )
    assert cluster.get("finetunejobs", "held") is None


def test_injected_faults_answer_once(api, cluster):
    core, _ = api
    cluster.call(lambda: cluster.api.fail("POST", "configmaps", 500))
    with pytest.raises(client.ApiException) as e:
        core.create_namespaced_config_map("f", cm("one"), _preload_content=False)
    assert e.value.status == 500
    core.create_namespaced_config_map("f", cm("one"), _preload_content=False)


def test_pods_services_and_config_maps_are_held_to_the_api_servers_rules(api):
    """So the operator's real children meet kubevalidation's rules in every emulator test."""
    core, _ = api
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {
            "containers": [{"name": "c", "image": "busybox"}],
            "tolerations": [{"key": "a", "operator": "Exists", "value": "b"}],
        },
    }
    with pytest.raises(client.ApiException) as e:
        core.create_namespaced_pod("ns1", pod, _preload_content=False)
    assert e.value.status == 422 and "spec.tolerations[0].value" in e.value.body
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "1st"},
        "spec": {"ports": [{"name": "a", "port": 80}]},
    }
    with pytest.raises(client.ApiException) as e:
        core.create_namespaced_service("ns1", service, _preload_content=False)
    assert e.value.status == 422 and "metadata.name" in e.value.body
