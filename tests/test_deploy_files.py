"""The shipped deploy files keep their safe defaults: nothing internal published, every
secret required (none baked in), Flower behind basic auth, no root, allowed roots set.

Read as data (PyYAML, the unit's lines); where the real tool is installed it checks the file
too (`docker-compose config`, `systemd-analyze verify`), and Flower is started the way the
files start it to show that its basic auth really is on.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from ocrq.core.settings import Settings
from ocrq.worker.queue_depth import QueueDepth, consumed_queues
from tests.conftest import BIN, REPO
from tests.servers import free_port

COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
UNIT = REPO / "deploy" / "systemd" / "ocrq-worker@.service"
K8S = sorted((REPO / "deploy" / "k8s").glob("*.yaml"))
SECRETS = {
    "REDIS_PASSWORD": "redis-secret-1",
    "POSTGRES_PASSWORD": "pg-secret-1",
    "OCRQ_API_TOKEN": "api-token-0123456789",
    "FLOWER_BASIC_AUTH": "admin:flower-secret-1",
}
ROOT = {"root", "0", "0:0", "root:root"}


def required(var: str) -> re.Pattern[str]:
    """`${VAR:?message}`: compose stops with the message when VAR is unset or empty."""
    return re.compile(r"\$\{" + var + r":\?[^}]+\}")


def dockerfile_user() -> str:
    users = [
        line.split(None, 1)[1].strip()
        for line in DOCKERFILE.read_text().splitlines()
        if line.startswith("USER ")
    ]
    return users[-1] if users else "root"


def test_dockerfile_runs_as_a_non_root_user() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    user = dockerfile_user()
    assert user not in ROOT and user.split(":")[0].isdigit()  # numeric: runAsNonRoot can check
    last_run = max(i for i, line in enumerate(lines) if line.startswith("RUN "))
    assert lines.index(f"USER {user}") > last_run  # installs as root, runs as the user


def test_compose_publishes_nothing_internal_and_requires_secrets() -> None:
    text = COMPOSE.read_text()
    services: dict[str, dict[str, Any]] = yaml.safe_load(text)["services"]
    assert "ports" not in services["redis"] and "ports" not in services["postgres"]
    published = {name: s["ports"] for name, s in services.items() if "ports" in s}
    assert set(published) == {"api", "flower"}
    for ports in published.values():
        assert all(str(p).startswith("127.0.0.1:") for p in ports), ports
    # Secrets: required, never defaulted.
    assert "--requirepass" in services["redis"]["command"]
    assert required("REDIS_PASSWORD").fullmatch(services["redis"]["command"][-1])
    pg_env = services["postgres"]["environment"]
    assert "POSTGRES_HOST_AUTH_METHOD" not in pg_env and "trust" not in json.dumps(services)
    assert required("POSTGRES_PASSWORD").fullmatch(pg_env["POSTGRES_PASSWORD"])
    assert required("FLOWER_BASIC_AUTH").fullmatch(
        services["flower"]["environment"]["FLOWER_BASIC_AUTH"]
    )
    assert required("OCRQ_API_TOKEN").fullmatch(services["api"]["environment"]["OCRQ_API_TOKEN"])
    assert not re.search(r"\$\{[A-Z_]*(PASSWORD|TOKEN|AUTH)[A-Z_]*:?-", text)  # no defaults
    for name in ("migrate", "worker", "api"):
        env = services[name]["environment"]
        assert required("REDIS_PASSWORD").search(env["OCRQ_BROKER_URL"])
        assert required("POSTGRES_PASSWORD").search(env["OCRQ_DATABASE_URL"])
    assert services["worker"]["environment"]["OCRQ_ALLOWED_ROOTS"] not in ("", "/")
    # No service runs as root: built ones take the Dockerfile's USER, the others set `user`.
    for name, service in services.items():
        user = dockerfile_user() if "build" in service else str(service.get("user", "root"))
        assert user not in ROOT, name


def test_compose_config_resolves_only_with_every_secret(tmp_path: Path) -> None:
    """docker-compose (Debian's 1.29 here) reads the file as Docker would, offline: it refuses
    it while a secret is missing and resolves the ports to loopback when all are given."""
    tool = shutil.which("docker-compose")
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    if tool is None:  # the same facts from the file alone: nothing here can default them
        for var in SECRETS:
            assert required(var).search(COMPOSE.read_text()), var
        assert all(str(p).startswith("127.0.0.1:") for p in services["api"]["ports"])
        return
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for missing in SECRETS:
        env = {**base, **{k: v for k, v in SECRETS.items() if k != missing}}
        proc = subprocess.run(
            [tool, "-f", str(COMPOSE), "config", "-q"], env=env, capture_output=True, text=True
        )
        assert proc.returncode != 0 and f"set {missing}" in proc.stderr, proc.stderr
    proc = subprocess.run(
        [tool, "-f", str(COMPOSE), "config"],
        env={**base, **SECRETS},
        capture_output=True,
        text=True,
        check=True,
    )
    resolved = yaml.safe_load(proc.stdout)["services"]
    assert resolved["flower"]["environment"]["FLOWER_BASIC_AUTH"] == SECRETS["FLOWER_BASIC_AUTH"]
    for name in ("api", "flower"):
        ports = resolved[name]["ports"]  # "ip:host:container/tcp" in 1.29, mappings in v2
        assert [p["host_ip"] if isinstance(p, dict) else p.split(":")[0] for p in ports] == [
            "127.0.0.1"
        ]
    assert "ports" not in resolved["redis"] and "ports" not in resolved["postgres"]


def k8s_documents() -> list[dict[str, Any]]:
    return [doc for path in K8S for doc in yaml.safe_load_all(path.read_text()) if doc]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_kubernetes_no_root_secrets_from_secrets_and_allowed_roots() -> None:
    docs = k8s_documents()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert {"ocrq-worker", "ocrq-api", "ocrq-flower"} <= set(deployments)
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
    worker = env_of(deployments["ocrq-worker"]["spec"]["template"]["spec"]["containers"][0])
    assert worker["OCRQ_ALLOWED_ROOTS"]["value"] not in ("", "/")
    api = env_of(deployments["ocrq-api"]["spec"]["template"]["spec"]["containers"][0])
    assert "secretKeyRef" in api["OCRQ_API_TOKEN"]["valueFrom"]
    flower = env_of(deployments["ocrq-flower"]["spec"]["template"]["spec"]["containers"][0])
    assert "secretKeyRef" in flower["FLOWER_BASIC_AUTH"]["valueFrom"]
    for service in (d for d in docs if d["kind"] == "Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"  # never NodePort/LB
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    assert all("authenticationRef" in t for t in scaled["spec"]["triggers"])  # Redis password


def unit_entries() -> list[tuple[str, str]]:
    """The unit's `Key=value` lines in order (repeated keys such as Environment= kept)."""
    entries = []
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            entries.append((key.strip(), value.strip()))
    return entries


def test_systemd_unit_is_hardened_and_sets_allowed_roots(tmp_path: Path) -> None:
    entries = unit_entries()
    settings = dict(entries)
    env = dict(v.split("=", 1) for k, v in entries if k == "Environment")
    assert env["OCRQ_ALLOWED_ROOTS"] not in ("", "/")
    assert settings["User"] not in ROOT
    assert settings["NoNewPrivileges"] == "yes" and settings["PrivateTmp"] == "yes"
    assert settings["ProtectSystem"] == "strict" and settings["CacheDirectory"] == "ocrq"
    assert "78" in settings["RestartPreventExitStatus"].split()  # start-up errors: no loop
    assert "--no-supervise" in settings["ExecStart"]
    tool = shutil.which("systemd-analyze")
    if tool is not None:  # every key known and every value parsed, as systemd reads them
        unit = tmp_path / UNIT.name
        unit.write_text(UNIT.read_text())
        proc = subprocess.run(
            [tool, "verify", "--man=no", str(tmp_path / "ocrq-worker@0.service")],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        problems = [
            line
            for line in (proc.stdout + proc.stderr).splitlines()
            if "is not executable" not in line  # /opt/ocrq is not installed here
        ]
        assert not problems, problems


def test_flower_started_as_deployed_requires_basic_auth(broker_url: str, tmp_path: Path) -> None:
    """Flower reads FLOWER_BASIC_AUTH from its environment, as compose and Kubernetes set it."""
    port = free_port()
    user, password = SECRETS["FLOWER_BASIC_AUTH"].split(":")
    log = (tmp_path / "flower.log").open("w")
    flower = subprocess.Popen(
        [
            str(BIN / "celery"),
            f"--broker={broker_url}",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
        ],
        env={"PATH": str(BIN), "FLOWER_BASIC_AUTH": SECRETS["FLOWER_BASIC_AUTH"]},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                anonymous = httpx.get(f"{base}/tasks", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and flower.poll() is None
                time.sleep(0.3)
        wrong = httpx.get(f"{base}/api/tasks", auth=(user, "nope"), timeout=5)
        right = httpx.get(f"{base}/tasks", auth=(user, password), timeout=5)
        # The JSON api takes the same login (FLOWER_UNAUTHENTICATED_API is for no auth at all),
        # and the container healthcheck's /healthcheck needs none.
        api = httpx.get(f"{base}/api/workers", auth=(user, password), timeout=5)
        healthcheck = httpx.get(f"{base}/healthcheck", timeout=5)
        # Flower's Prometheus /metrics is served without the login (Flower's own choice, as
        # docs/deploy.md says): counts by task name, state and worker, never a task's arguments.
        metrics = httpx.get(f"{base}/metrics", timeout=5)
    finally:
        flower.terminate()
        flower.wait(20)
        log.close()
    assert anonymous.status_code == 401 and wrong.status_code == 401
    assert right.status_code == 200
    assert api.status_code == 200 and healthcheck.status_code == 200
    assert metrics.status_code == 200 and "flower_" in metrics.text


# -- start order, persistence, networks, grace, health (issue 15) ---------------------------

SCHEMAS = REPO / "tests" / "schemas"
DOCKERIGNORE = REPO / ".dockerignore"
K8S_VERSION = "1.30.0"


def compose_errors(document: dict[str, Any]) -> list[str]:
    import jsonschema

    schema = json.loads((SCHEMAS / "compose_spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]


def test_compose_file_matches_the_compose_spec_schema() -> None:
    document = yaml.safe_load(COMPOSE.read_text())
    assert compose_errors(document) == []
    # The check can fail: a misspelt condition and an unknown key are caught.
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["worker"]["depends_on"]["migrate"]["condition"] = "service_finished"
    broken["services"]["redis"]["stop_grace"] = "120s"
    errors = compose_errors(broken)
    assert any("depends_on" in e for e in errors) and any("stop_grace" in e for e in errors)


def seconds(value: str) -> float:
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", value)
    assert match and value, value
    return int(match.group(1) or 0) * 60 + int(match.group(2) or 0)


def test_compose_starts_in_order_persists_and_keeps_internals_internal() -> None:
    document = yaml.safe_load(COMPOSE.read_text())
    services: dict[str, dict[str, Any]] = document["services"]
    # Every dependency waits on health or completion, never on a mere start, and a service
    # waited on for its health has a healthcheck.
    for name, service in services.items():
        for dep, rule in service.get("depends_on", {}).items():
            assert rule["condition"] in ("service_healthy", "service_completed_successfully"), (
                name,
                dep,
            )
            if rule["condition"] == "service_healthy":
                assert "test" in services[dep]["healthcheck"], dep
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["restart"] == "no"  # one shot
    for name in ("worker", "api"):  # both write rows: after the migrations
        assert services[name]["depends_on"]["migrate"]["condition"] == (
            "service_completed_successfully"
        )
    # Persistence: named volumes for the data, Redis with its append-only file.
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert "redis-data:/data" in services["redis"]["volumes"]
    assert "pg-data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert {"redis-data", "pg-data"} <= set(document["volumes"])
    # Internal services only on the internal network.
    assert document["networks"]["backend"]["internal"] is True
    for name in ("redis", "postgres"):
        assert services[name]["networks"] == ["backend"], name
    # Workers: unsupervised, healthchecked by `ocrq health` on their metrics port, and given
    # the time a warm shutdown takes.
    for name in ("worker", "worker-gpu"):
        worker = services[name]
        assert "--no-supervise" in worker["command"], name
        assert worker["healthcheck"]["test"][1:3] == ["ocrq", "health"], name
        assert worker["environment"]["OCRQ_METRICS_PORT"], name
        # The default is loopback: a container's probe and Prometheus come from outside it.
        assert worker["environment"]["OCRQ_METRICS_ADDRESS"] == "0.0.0.0", name
        assert seconds(worker["stop_grace_period"]) >= 60, name
        assert worker["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    gpu = services["worker-gpu"]["deploy"]["resources"]
    assert gpu["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert "memory" in gpu["reservations"] and "memory" in gpu["limits"]
    assert all(s.get("restart") for s in services.values())


def test_dockerfile_healthcheck_and_dockerignore() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^HEALTHCHECK .*CMD \[\"ocrq\", \"health\"\]$", text, re.M)
    assert "OCRQ_METRICS_PORT=" in text and "OCRQ_METRICS_ADDRESS=0.0.0.0" in text
    ignored = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()}
    assert {".venv", ".git", ".env", "bench/results"} <= ignored
    # What the Dockerfile copies is not ignored.
    copies = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    copied = {path for paths in copies for path in paths}
    assert copied and not copied & ignored


def deployment(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)


def keda_errors(document: dict[str, Any]) -> list[str]:
    import jsonschema

    schema = json.loads((SCHEMAS / "keda-v1alpha1.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]


def k8s_errors(document: dict[str, Any]) -> list[str]:
    """kubeconform-style: strict schemas of Kubernetes' kinds (kubernetes-validate ships
    them), the committed KEDA schema for KEDA's."""
    if document["apiVersion"].startswith("keda.sh/"):
        return keda_errors(document)
    import kubernetes_validate

    try:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [str(exc)]
    return []


def test_kubernetes_manifests_match_their_schemas() -> None:
    docs = k8s_documents()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "Job", "ScaledObject"}
    for doc in docs:
        assert k8s_errors(doc) == [], (doc["kind"], doc["metadata"]["name"])
    # The checks can fail: an unknown field, a number where KEDA wants a string.
    worker = deployment(docs, "ocrq-worker")
    worker["spec"]["template"]["spec"]["terminationGracePeriod"] = 600
    assert k8s_errors(worker)
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    scaled["spec"]["triggers"][0]["metadata"]["listLength"] = 64
    assert keda_errors(scaled)


def test_kubernetes_worker_probes_resources_grace_and_migration_job() -> None:
    docs = k8s_documents()
    worker = deployment(docs, "ocrq-worker")
    pod = worker["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "--no-supervise" in container["args"]
    assert pod["terminationGracePeriodSeconds"] >= 120
    # A recycle is a container exit; under 10 minutes of running the kubelet backs its restart
    # off (up to 5 min). At the H200's measured service mix (31.5 images/s, run 18) the
    # worker must run over 10 minutes between recycles.
    assert int(env_of(container)["OCRQ_MAX_IMAGES"]["value"]) / 31.5 > 600
    port = int(env_of(container)["OCRQ_METRICS_PORT"]["value"])
    assert env_of(container)["OCRQ_METRICS_ADDRESS"]["value"] == "0.0.0.0"  # kubelet, Prometheus
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        get = container[probe]["httpGet"]
        assert get["path"] == path and named.get(get["port"], get["port"]) == port, probe
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert resources["limits"]["nvidia.com/gpu"] == 1
    for each in (d for d in docs if d["kind"] == "Deployment"):
        for c in each["spec"]["template"]["spec"]["containers"]:
            assert "requests" in c["resources"], each["metadata"]["name"]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    (migrate,) = job["spec"]["template"]["spec"]["containers"]
    assert migrate["args"] == ["ocrq", "migrate"]
    assert job["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_systemd_unit_serves_health_and_waits_for_warm_shutdown() -> None:
    entries = unit_entries()
    env = dict(v.split("=", 1) for k, v in entries if k == "Environment")
    assert env["OCRQ_METRICS_PORT"].startswith("910")
    assert seconds(dict(entries)["TimeoutStopSec"] + "s") >= 120


def test_systemd_worker_hostname_is_one_celery_accepts() -> None:
    """The node name as Celery gets it once systemd has expanded the unit's specifiers (%i the
    instance, %% a lone %): Celery formats it with its own specifiers, and one it does not know
    (`%H`, from a `%%H` in the unit) killed every start in a loop."""
    from celery.utils.nodenames import host_format

    start = dict(unit_entries())["ExecStart"].split()
    given = start[start.index("--hostname") + 1]
    expanded = re.sub(r"%(.)", lambda m: {"i": "0", "%": "%"}[m.group(1)], given)
    name = host_format(expanded)
    assert name.startswith("ocrq-gpu0@") and "%" not in name, name


def test_grafana_dashboard_queries_only_metrics_the_worker_exports() -> None:
    """Every series a panel queries is one ocrq/core/metrics.py defines (a renamed metric
    would leave a panel silently empty)."""
    from prometheus_client import REGISTRY

    import ocrq.core.metrics  # noqa: F401 (registers the metrics)

    dashboard = json.loads((REPO / "deploy" / "grafana" / "ocrq-dashboard.json").read_text())
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    # The worker's registry, and what /metrics adds at scrape time (ocrq/worker/queue_depth.py).
    depth = QueueDepth(Settings(broker_url="redis://127.0.0.1:1/0"), ["ocr"])
    families = [*REGISTRY.collect(), *depth.describe()]
    exported = {
        family.name + suffix for family in families for suffix in suffixes.get(family.type, ("",))
    }
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bocrq_[a-z_]+", target["expr"])
    }
    assert len(queried) >= 15 and queried <= exported, queried - exported


# -- uploads on one shared volume, claims, image layers, install steps (issue 27) ----------

API_UNIT = REPO / "deploy" / "systemd" / "ocrq-api.service"
UPLOAD = "OCRQ_UPLOAD_DIR"


def unit_env(path: Path) -> dict[str, str]:
    lines = [line.split("=", 1)[1] for line in path.read_text().splitlines() if line.startswith(
        "Environment=")]
    return dict(v.split("=", 1) for v in lines)


def test_compose_shares_one_upload_volume_between_the_api_and_the_workers() -> None:
    document = yaml.safe_load(COMPOSE.read_text())
    services: dict[str, dict[str, Any]] = document["services"]
    folders = {name: services[name]["environment"].get(UPLOAD) for name in
               ("api", "worker", "worker-gpu")}
    (folder,) = set(folders.values())  # one setting, the same on every side
    assert folder and folder.startswith("/"), folders
    volumes = {}
    for name in folders:
        mounts = [str(v).split(":") for v in services[name].get("volumes", [])]
        (mount,) = [m for m in mounts if m[1] == folder]
        volumes[name] = mount[0]
        if name == "api":
            assert mount[2:] in ([], ["rw"]), mount  # the api writes uploads
    (volume,) = set(volumes.values())
    assert volume in document["volumes"], volumes  # a named volume, not a per-host bind
    # The image makes the folder for its user, so a fresh named volume there is writable.
    text = DOCKERFILE.read_text()
    assert re.search(r"install -d -o 10001 -g 10001 [^\n]*" + re.escape(folder) + r"\b", text)


def pod_of(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return deployment(docs, name)["spec"]["template"]["spec"]


def test_kubernetes_api_and_workers_mount_one_shared_upload_claim() -> None:
    docs = k8s_documents()
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    shared = {}
    for name in ("ocrq-api", "ocrq-worker"):
        pod = pod_of(docs, name)
        (container,) = pod["containers"]
        folder = env_of(container)[UPLOAD]["value"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        shared[name] = (folder, volume["persistentVolumeClaim"]["claimName"])
        if name == "ocrq-api":
            assert not mount.get("readOnly"), mount
    ((folder, claim),) = set(shared.values())
    # Pods on several nodes mount it at once: ReadWriteMany.
    assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"]
    # The api's root file system is read-only: the uploads volume is where it writes, and a
    # writable /tmp where multipart uploads over 1 MiB are spooled first.
    api = pod_of(docs, "ocrq-api")
    assert api["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    (tmp,) = [m for m in api["containers"][0]["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in next(v for v in api["volumes"] if v["name"] == tmp["name"])
    assert api["securityContext"]["fsGroup"] == api["securityContext"]["runAsGroup"]


def test_kubernetes_every_claim_a_pod_mounts_is_shipped() -> None:
    docs = k8s_documents()
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    used = {
        v["persistentVolumeClaim"]["claimName"]
        for d in docs
        if d["kind"] in ("Deployment", "Job")
        for v in d["spec"]["template"]["spec"].get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    assert {"ocrq-uploads", "ocrq-models", "ocrq-images"} <= used
    assert used <= claims, used - claims
    for doc in docs:
        if doc["kind"] == "PersistentVolumeClaim":
            assert doc["spec"]["resources"]["requests"]["storage"], doc["metadata"]["name"]


def test_keda_scales_on_every_queue_the_workers_consume() -> None:
    docs = k8s_documents()
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    lists = {t["metadata"]["listName"] for t in scaled["spec"]["triggers"] if t["type"] == "redis"}
    assert lists == set(consumed_queues(Settings.model_construct()))  # the defaults


def test_systemd_api_and_workers_share_the_upload_folder(tmp_path: Path) -> None:
    api, worker = unit_env(API_UNIT), unit_env(UNIT)
    assert api[UPLOAD] == worker[UPLOAD]
    settings = dict(
        line.split("=", 1) for line in API_UNIT.read_text().splitlines() if "=" in line
        and not line.startswith("#")
    )
    # StateDirectory= creates it for User= and leaves it writable under ProtectSystem=strict.
    assert "/var/lib/" + settings["StateDirectory"] == api[UPLOAD]
    assert settings["ProtectSystem"] == "strict" and settings["NoNewPrivileges"] == "yes"
    assert settings["User"] == dict(unit_entries())["User"] not in ROOT
    assert "78" in settings["RestartPreventExitStatus"].split()
    tool = shutil.which("systemd-analyze")
    if tool is not None:
        (tmp_path / API_UNIT.name).write_text(API_UNIT.read_text())
        proc = subprocess.run(
            [tool, "verify", "--man=no", str(tmp_path / API_UNIT.name)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        problems = [
            line
            for line in (proc.stdout + proc.stderr).splitlines()
            if "is not executable" not in line  # /opt/ocrq is not installed here
        ]
        assert not problems, problems


def test_systemd_install_steps_make_the_paths_the_units_run() -> None:
    """docs/deploy.md's install steps create the venv, user and env file the units name."""
    steps = (REPO / "docs" / "deploy.md").read_text()
    for unit in (UNIT, API_UNIT):
        entries = dict(
            line.split("=", 1) for line in unit.read_text().splitlines() if "=" in line
            and not line.startswith("#")
        )
        binary = entries["ExecStart"].split()[0]
        venv = binary.removesuffix("/bin/ocrq")
        assert venv != binary and f"-m venv {venv}" in steps, venv
        assert f"{venv}/bin/pip install" in steps
        assert "useradd --system" in steps and entries["User"] in steps
        assert entries["EnvironmentFile"].lstrip("-") in steps
        assert f"deploy/systemd/{unit.name}" in steps
    assert f"{venv}/bin/ocrq migrate" in steps


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    for line in joined.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_installs_dependencies_in_a_layer_before_the_code(tmp_path: Path) -> None:
    """A code edit must not reinstall the dependencies: they are installed from pyproject.toml
    alone before the code is copied; the code then goes in with --no-deps. Without a Docker
    daemon here, the build's copies are replayed into a folder: they must be enough to list the
    requirements and to build the package (migrations inside)."""
    steps = dockerfile_instructions()
    copies = [(i, args.split()) for i, (word, args) in enumerate(steps) if word == "COPY"]
    runs = [(i, args) for i, (word, args) in enumerate(steps) if word == "RUN"]
    deps_at, deps = next((i, a) for i, a in runs if "pip install" in a and " -r " in a)
    code_at = next(i for i, args in copies if args[0] == "ocrq")
    assert deps_at < code_at
    before = {src for i, args in copies if i < deps_at for src in args[:-1]}
    assert before == {"pyproject.toml", "deploy/pyproject_deps.py"}, before
    own = next(a for i, a in runs if i > code_at and "pip install" in a)
    assert "--no-deps" in own
    # Replay the copies (WORKDIR /src) and run what the RUN lines run.
    src = tmp_path / "src"
    src.mkdir()
    for _, args in copies:
        *sources, dest = args
        for source in sources:
            target = src / dest / Path(source).name if dest.endswith("/") else src / dest
            if (REPO / source).is_dir():
                shutil.copytree(REPO / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(REPO / source, target)
    extras = next(a for w, a in steps if w == "ARG" and a.startswith("EXTRAS=")).split("=", 1)[1]
    assert "pyproject_deps.py pyproject.toml" in deps
    listed = subprocess.run(
        [str(BIN / "python"), "pyproject_deps.py", "pyproject.toml", extras],
        cwd=src,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras.split(","):
        wanted += project["optional-dependencies"][extra]
    assert set(listed) == set(wanted) and not any(r.startswith("ocrq") for r in listed)
    wheel = subprocess.run(
        [str(BIN / "python"), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True,
        text=True,
    )
    assert wheel.returncode == 0, wheel.stdout + wheel.stderr
    import zipfile

    (built,) = (tmp_path / "dist").glob("ocrq-*.whl")
    names = zipfile.ZipFile(built).namelist()
    assert "ocrq/_migrations/env.py" in names and "ocrq/worker/queue_depth.py" in names
