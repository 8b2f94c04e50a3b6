"""The secrets directory is made owner-only, refused when others could read it, and read
back into the credentials Dynamo and etcd get; the generated certificates chain to the CA;
the etcd and NATS member command lines and configs hold what they must and no secret in
argv."""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from dynamod.cluster import etcd_member, nats_member, secrets
from dynamod.cluster.secrets_env import dynamo_env
from tests import cli_inprocess

NODES = {"head": "10.77.0.1", "n1": "10.77.0.2", "n2": "10.77.0.3"}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> secrets.Secrets:
    return secrets.init(tmp_path_factory.mktemp("s") / "secrets", NODES)


def test_init_makes_every_file_owner_only(made: secrets.Secrets) -> None:
    assert os.stat(made.path).st_mode & 0o777 == 0o700
    paths = list(made.path.rglob("*"))
    assert len([p for p in paths if p.is_file()]) == 3 + 6 * len(NODES)
    for path in paths:
        assert os.stat(path).st_mode & 0o777 == (0o700 if path.is_dir() else 0o600), path


def test_passwords_are_distinct_and_long(made: secrets.Secrets) -> None:
    c = made.credentials
    words = [c.etcd_root_password, c.etcd_password, c.nats_password, c.nats_route_password]
    assert len(set(words)) == 4 and all(len(w) >= 32 for w in words)


def test_certificates_chain_to_the_ca_and_name_the_node(made: secrets.Secrets) -> None:
    ca = x509.load_pem_x509_certificate(made.ca_cert.read_bytes())
    for name, address in NODES.items():
        files = made.node(name)
        server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
        server.verify_directly_issued_by(ca)
        sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert address in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
        client = x509.load_pem_x509_certificate(files.client_cert.read_bytes())
        client.verify_directly_issued_by(ca)
        # Never an etcd user's name: a certificate alone must not log in as root or the stack.
        cn = client.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
        assert cn not in {"root", made.credentials.etcd_user}
        ssl.create_default_context(cafile=str(made.ca_cert)).load_cert_chain(
            files.client_cert, files.client_key
        )


def test_load_refuses_a_directory_others_can_read(tmp_path: Path) -> None:
    made = secrets.init(tmp_path / "s", {"head": "10.0.0.1"})
    os.chmod(made.path, 0o750)
    with pytest.raises(secrets.SecretsError, match=r"s: mode 0750 lets group or others in"):
        secrets.load(made.path)


def test_load_refuses_a_file_others_can_read_and_names_it(tmp_path: Path) -> None:
    made = secrets.init(tmp_path / "s", {"head": "10.0.0.1"})
    os.chmod(made.node("head").client_key, 0o644)
    with pytest.raises(secrets.SecretsError) as info:
        secrets.load(made.path)
    assert str(info.value).startswith(f"{made.node('head').client_key}: mode 0644")


def test_load_names_a_missing_field(tmp_path: Path) -> None:
    made = secrets.init(tmp_path / "s", {"head": "10.0.0.1"})
    doc = json.loads((made.path / secrets.CREDENTIALS).read_text())
    del doc["nats_password"]
    (made.path / secrets.CREDENTIALS).write_text(json.dumps(doc))
    with pytest.raises(secrets.SecretsError, match="field 'nats_password' missing"):
        secrets.load(made.path)


def test_cli_init_refuses_group_readable_dir_and_non_empty_dir(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    result = cli_inprocess.run(["secrets", "init", str(open_dir), "--nodes", "head=10.0.0.1"])
    assert result.code == 2
    assert result.stderr.strip().count("\n") == 0
    assert "mode 0755 lets group or others in" in result.stderr
    assert list(open_dir.iterdir()) == []
    good = tmp_path / "good"
    first = cli_inprocess.run(["secrets", "init", str(good), "--nodes", "head=10.0.0.1"])
    assert first.code == 0, first.stderr
    before = (good / secrets.CREDENTIALS).read_bytes()
    again = cli_inprocess.run(["secrets", "init", str(good), "--nodes", "head=10.0.0.1"])
    assert again.code == 2 and "never overwritten" in again.stderr
    assert (good / secrets.CREDENTIALS).read_bytes() == before
    for word in json.loads(before)["etcd_password"], json.loads(before)["nats_password"]:
        assert word not in first.stdout + first.stderr


def test_cli_init_refuses_a_bad_nodes_list(tmp_path: Path) -> None:
    result = cli_inprocess.run(["secrets", "init", str(tmp_path / "x"), "--nodes", "head"])
    assert result.code == 2
    assert "nodes: expected NAME=ADDRESS" in result.stderr
    assert not (tmp_path / "x").exists()


def test_etcd_auth_is_none_without_secrets_and_pem_contents_with(made: secrets.Secrets) -> None:
    assert secrets.load_etcd_auth("") is None
    auth = secrets.load_etcd_auth(made.path, "n1")
    assert auth is not None and auth.user == "dynamod"
    assert auth.cert_pem == made.node("n1").client_cert.read_text()
    assert auth.ca_pem is not None and auth.ca_pem.startswith("-----BEGIN CERTIFICATE-----")


def test_dynamo_env_gives_pem_contents_and_tls_paths(made: secrets.Secrets) -> None:
    env = dynamo_env(made, "n2", {"ETCD_ENDPOINTS": "https://x:2379", "NATS_SERVER": "nats://x"})
    assert env["ETCD_AUTH_CLIENT_KEY"] == made.node("n2").stack_key.read_text()
    assert "ETCD_AUTH_PASSWORD" not in env  # a login by certificate (Dynamo 1.6.1)
    stack = x509.load_pem_x509_certificate(made.node("n2").stack_cert.read_bytes())
    cn = stack.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
    assert cn == made.credentials.etcd_user
    assert env["ETCD_AUTH_CA"].startswith("-----BEGIN CERTIFICATE-----")
    assert env["DYN_TCP_TLS_CERT_PATH"] == str(made.node("n2").server_cert)
    assert env["NATS_AUTH_PASSWORD"] == made.credentials.nats_password
    assert dynamo_env(made, "n2", {}) == {}
    with pytest.raises(secrets.SecretsError, match="no certificates for node 'n9'"):
        dynamo_env(made, "n9", {"ETCD_ENDPOINTS": "x"})


def test_etcd_member_argv_requires_client_certs_and_holds_no_secret(made: secrets.Secrets) -> None:
    argv = etcd_member.etcd_argv(
        etcd="etcd", name="n1", nodes=NODES, loaded=made, data_dir=Path("/d"),
        client_port=2379, peer_port=2380, metrics_port=2381, cluster_token="t",
    )  # fmt: skip
    joined = " ".join(argv)
    assert "--client-cert-auth" in argv and "--peer-client-cert-auth" in argv
    assert "--listen-client-urls https://10.77.0.2:2379,https://127.0.0.1:2379" in joined
    assert "--listen-metrics-urls http://127.0.0.1:2381" in joined
    assert "--auto-compaction-mode periodic --auto-compaction-retention 1h" in joined
    assert "head=https://10.77.0.1:2380,n1=https://10.77.0.2:2380,n2=https://10.77.0.3:2380" in argv
    assert "http://10.77" not in joined
    for word in vars(made.credentials).values():
        assert word not in joined
    kept = etcd_member.etcd_argv(
        etcd="etcd", name="n1", nodes=NODES, loaded=made, data_dir=Path("/d"),
        client_port=2379, peer_port=2380, metrics_port=2381, cluster_token="t", history="0",
    )  # fmt: skip
    assert "--auto-compaction-retention 0" in " ".join(kept)
    for bad in ("", "1 h", "an hour", "-1h", "1d"):
        with pytest.raises(secrets.SecretsError, match="--history: a duration"):
            etcd_member.etcd_argv(
                etcd="etcd", name="n1", nodes=NODES, loaded=made, data_dir=Path("/d"),
                client_port=2379, peer_port=2380, metrics_port=2381, cluster_token="t",
                history=bad,
            )  # fmt: skip
    with pytest.raises(secrets.SecretsError, match="node 'n7' is not in --nodes"):
        etcd_member.etcd_argv(
            etcd="etcd", name="n7", nodes=NODES, loaded=made, data_dir=Path("/d"),
            client_port=1, peer_port=2, metrics_port=3, cluster_token="t",
        )  # fmt: skip


def test_nats_config_routes_to_the_other_nodes_with_auth(made: secrets.Secrets) -> None:
    text = nats_member.nats_config(
        name="head", nodes=NODES, loaded=made, client_port=4222, cluster_port=6222,
        monitor_port=8222, cluster_name="dynamod",
    )  # fmt: skip
    pw = made.credentials.nats_route_password
    assert f"route:{pw}@10.77.0.2:6222" in text and f"route:{pw}@10.77.0.3:6222" in text
    assert "@10.77.0.1:6222" not in text
    assert '"10.77.0.1:4222"' in text and '"127.0.0.1:8222"' in text
    assert made.credentials.nats_password in text


def test_nats_config_file_is_written_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "nats" / "nats.conf"
    nats_member.write_owner_only(path, "secret")
    assert os.stat(path).st_mode & 0o777 == 0o600 and path.read_text() == "secret"


def test_etcdctl_refusals_are_read_from_its_noise() -> None:
    from dynamod.cluster.etcd_auth import _said

    noise = (
        '{"level":"warn","msg":"retrying of unary invoker failed","error":"rpc error"}\n'
        "Error: etcdserver: authentication failed, invalid user ID or password\n"
    )
    assert _said(noise) == "etcdserver: authentication failed, invalid user ID or password"
    tls = (
        'WARNING: grpc: addrConn.createTransport failed to connect: desc = "transport: '
        'authentication handshake failed: remote error: tls: bad certificate". Reconnecting...\n'
        "Error: context deadline exceeded\n"
    )
    assert _said(tls) == (
        "TLS handshake refused (remote error: tls: bad certificate); context deadline exceeded"
    )
