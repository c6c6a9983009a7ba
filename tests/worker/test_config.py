"""`kvhandoff run`'s settings: flags, environment fallbacks, and a `ConfigError` that
names the setting for every invalid one, before anything connects."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import kvhandoff.worker.commands.run as run_command
from kvhandoff.worker.bus.settings import NatsSettings
from kvhandoff.worker.cli import build_parser, main
from kvhandoff.worker.config import TierConfig, WorkerConfig, worker_config
from kvhandoff.worker.errors import ConfigError
from kvhandoff.worker.tier.membership import TierSettings
from kvhandoff.worker.tier.service import tier_settings


@pytest.fixture(autouse=True)
def clean_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No setting leaks in from the environment, and relative paths land in tmp_path."""
    for name in list(os.environ):
        if name.startswith(("NATS_", "KVHANDOFF_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield


def parse(*argv: str) -> argparse.Namespace:
    """Parse `kvhandoff run ARGV`; environment fallbacks are read here, when defaults are built."""
    arguments = ["run", *argv]
    return build_parser(arguments).parse_args(arguments)


def test_defaults() -> None:
    assert worker_config(parse()) == WorkerConfig(
        nats=NatsSettings(
            url="nats://127.0.0.1:4222",
            user=None,
            password=None,
            token=None,
            creds=None,
            tls_ca=None,
            tls_cert=None,
            tls_key=None,
            subject_prefix="kvhandoff",
        ),
        db_path=Path("kvhandoff.db"),
        tier=TierConfig(
            partitions=1,
            stream="KVHANDOFF_IN",
            consumer="kvhandoff-worker",
            completion_ttl_s=3600.0,
            ack_wait_s=1.0,
            priority_timeout_s=3.0,
            batch_size=512,
        ),
        retry_interval_s=5.0,
        synchronous="FULL",
        retention_s=None,
        metrics_host="127.0.0.1",  # the endpoint has no authentication
        metrics_port=9464,
        log_format="text",
        log_level="INFO",
    )


def test_the_tiers_streams_are_named_after_its_input_stream_unless_told() -> None:
    """The default tier keeps the names it always had; another input stream names its own, so
    that a second tier on the account needs only `--subject-prefix` and `--stream`."""
    default = worker_config(parse())
    assert (default.tier.done_stream, default.tier.log_stream) == (
        "KVHANDOFF_DONE",
        "KVHANDOFF_LOG",
    )
    other = worker_config(parse("--stream", "TIERB_IN"))
    assert (other.tier.done_stream, other.tier.log_stream) == ("TIERB_DONE", "TIERB_LOG")
    bare = worker_config(parse("--stream", "tierb"))
    assert (bare.tier.done_stream, bare.tier.log_stream) == ("tierb_DONE", "tierb_LOG")
    told = worker_config(parse("--stream", "TIERB_IN", "--done-stream", "D", "--log-stream", "L"))
    assert (told.tier.done_stream, told.tier.log_stream) == ("D", "L")
    # The rejections are kept beside the completions, and named after them: a frontend, which
    # is told the completion stream alone, finds them so.
    assert default.tier.rejections_stream == "KVHANDOFF_REJECTED"
    assert (other.tier.rejections_stream, told.tier.rejections_stream) == (
        "TIERB_REJECTED",
        "D_REJECTED",
    )
    assert tier_settings(other) == TierSettings(partitions=1, stream="TIERB_IN")


def test_the_log_is_kept_a_week_unless_told_and_the_default_is_one_partition_in_db(
    tmp_path: Path,
) -> None:
    tier = ["--partitions", "4", "--data-dir", str(tmp_path)]
    assert worker_config(parse(*tier)).tier_retention_s == 7 * 86_400
    told = worker_config(parse(*tier, "--retention", "1h"))
    assert (told.retention_s, told.tier_retention_s) == (3600, 3600)
    default = worker_config(parse("--db", str(tmp_path / "k.db")))
    assert (default.tier.partitions, default.tier_retention_s) == (1, 7 * 86_400)
    # `run` locks the one file itself, or the directory, whose partition files it locks apart.
    assert default.partition_file(0) == default.locked_path == tmp_path / "k.db"
    one = worker_config(parse("--partitions", "1", "--data-dir", str(tmp_path)))
    assert one.partition_file(0) == tmp_path / "partition-0.db"
    assert one.locked_path == tmp_path / "worker"


def test_environment_fallbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ca.pem").touch()
    (tmp_path / "client.crt").touch()
    (tmp_path / "client.key").touch()
    (tmp_path / "logs").mkdir()
    for name, value in {
        "NATS_URL": "tls://nats-0:4222,tls://nats-1:4222",
        "NATS_USER": "worker",
        "NATS_PASSWORD": "secret",
        "NATS_TLS_CA": "ca.pem",
        "NATS_TLS_CERT": "client.crt",
        "NATS_TLS_KEY": "client.key",
        "KVHANDOFF_SUBJECT_PREFIX": "prod.kv",
        "KVHANDOFF_DB": "logs/worker.db",
        "KVHANDOFF_STREAM": "PROD_IN",
        "KVHANDOFF_CONSUMER": "worker-a",
        "KVHANDOFF_RETRY_INTERVAL": "250ms",
        "KVHANDOFF_SYNCHRONOUS": "normal",
        "KVHANDOFF_RETENTION": "7d",
        "KVHANDOFF_METRICS_HOST": "0.0.0.0",
        "KVHANDOFF_METRICS_PORT": "0",
        "KVHANDOFF_LOG_FORMAT": "json",
        "KVHANDOFF_LOG_LEVEL": "debug",
    }.items():
        monkeypatch.setenv(name, value)

    config = worker_config(parse())

    assert config.nats == NatsSettings(
        url="tls://nats-0:4222,tls://nats-1:4222",
        user="worker",
        password="secret",
        tls_ca=Path("ca.pem"),
        tls_cert=Path("client.crt"),
        tls_key=Path("client.key"),
        subject_prefix="prod.kv",
    )
    assert config.db_path == Path("logs/worker.db")
    assert (config.tier.stream, config.tier.consumer) == ("PROD_IN", "worker-a")
    assert (config.tier.done_stream, config.tier.log_stream) == ("PROD_DONE", "PROD_LOG")
    assert config.retry_interval_s == pytest.approx(0.25)
    assert config.synchronous == "NORMAL"
    assert config.retention_s == 7 * 86_400
    assert (config.metrics_host, config.metrics_port) == ("0.0.0.0", 0)
    assert (config.log_format, config.log_level) == ("json", "DEBUG")


def test_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_URL", "nats://from-env:4222")
    monkeypatch.setenv("KVHANDOFF_RETRY_INTERVAL", "1m")
    monkeypatch.setenv("KVHANDOFF_SYNCHRONOUS", "NORMAL")
    monkeypatch.setenv("KVHANDOFF_METRICS_HOST", "0.0.0.0")

    config = worker_config(
        parse(
            "--nats-url",
            "nats://from-flag:4222",
            "--retry-interval",
            "2s",
            "--synchronous",
            "extra",
            "--metrics-host",
            "10.0.0.7",
        )
    )

    assert config.nats.url == "nats://from-flag:4222"
    assert config.retry_interval_s == 2.0
    assert config.synchronous == "EXTRA"
    assert config.metrics_host == "10.0.0.7"


@dataclass(frozen=True)
class Invalid:
    """`kvhandoff run ARGV`, with `env` set and `files` created, fails with `error` first."""

    argv: list[str]
    error: str
    env: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


INVALID = [
    Invalid(["--nats-url", "http://x:4222"], "--nats-url: 'http://x:4222' is not a nats://"),
    Invalid(["--nats-url", "nats://a:4222,http://b:4222"], "--nats-url: 'http://b:4222'"),
    Invalid(["--nats-url", "nats://"], "--nats-url: 'nats://'"),
    Invalid(["--nats-url", "nats://a:99999"], "--nats-url: 'nats://a:99999'"),
    Invalid([], "--nats-url: 'localhost:4222'", env={"NATS_URL": "localhost:4222"}),
    Invalid(["--nats-user", "worker"], "--nats-user and --nats-password go together"),
    Invalid([], "--nats-user and --nats-password go together", env={"NATS_PASSWORD": "secret"}),
    Invalid(
        ["--tls-cert", "client.crt"], "--tls-cert and --tls-key go together", files=["client.crt"]
    ),
    Invalid(["--nats-creds", "worker.creds"], "--nats-creds: no such file worker.creds"),
    Invalid([], "--tls-ca: no such file ca.pem", env={"NATS_TLS_CA": "ca.pem"}),
    Invalid(["--subject-prefix", "kv.>"], "--subject-prefix: 'kv.>'"),
    Invalid(["--stream", "KV.IN"], "--stream: 'KV.IN'"),
    Invalid([], "--stream: 'KV IN'", env={"KVHANDOFF_STREAM": "KV IN"}),
    Invalid(["--consumer", "worker*"], "--consumer: 'worker*'"),
    Invalid(
        ["--done-stream", "L_DONE", "--log-stream", "L_REJECTED"],
        "--done-stream: 'L_DONE' names the rejection stream 'L_REJECTED', which is the input",
    ),
    Invalid(["--batch-size", "0"], "--batch-size: 0 is not in 1..10000"),
    Invalid(["--batch-size", "10001"], "--batch-size: 10001 is not in 1..10000"),
    Invalid(["--retry-interval", "0s"], "--retry-interval must be positive"),
    Invalid([], "--retry-interval must be positive", env={"KVHANDOFF_RETRY_INTERVAL": "0ms"}),
    Invalid(["--ack-wait", "0s"], "--ack-wait must be positive"),
    Invalid(["--synchronous", "off"], "--synchronous: 'OFF' is not FULL, NORMAL or EXTRA"),
    Invalid([], "--synchronous: 'FAST'", env={"KVHANDOFF_SYNCHRONOUS": "fast"}),
    Invalid(["--retention", "0"], "--retention must be positive"),
    Invalid(["--metrics-port", "65536"], "--metrics-port: 65536 is not a port"),
    Invalid(["--db", "missing/kvhandoff.db"], "--db: directory missing does not exist"),
    Invalid(
        [], "--db: directory missing does not exist", env={"KVHANDOFF_DB": "missing/kvhandoff.db"}
    ),
    Invalid([], "--log-format: 'xml' is not text or json", env={"KVHANDOFF_LOG_FORMAT": "xml"}),
    Invalid(["--log-level", "verbose"], "--log-level: 'VERBOSE' is not a logging level"),
    Invalid(["--partitions", "4"], "--partitions above 1 needs --data-dir"),
    Invalid([], "--partitions above 1 needs --data-dir", env={"KVHANDOFF_PARTITIONS": "4"}),
    Invalid(["--partitions", "0", "--data-dir", "."], "--partitions: 0 is not in 1..1024"),
    Invalid(["--partitions", "1025", "--data-dir", "."], "--partitions: 1025 is not in 1..1024"),
]


@pytest.mark.parametrize("case", INVALID, ids=[case.error for case in INVALID])
def test_each_invalid_setting_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case: Invalid
) -> None:
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    for name in case.files:
        (tmp_path / name).touch()
    args = parse(*case.argv)

    with pytest.raises(ConfigError, match=f"^{re.escape(case.error)}"):
        worker_config(args)


def test_a_missing_data_dir_is_made_private_with_its_parents(tmp_path: Path) -> None:
    config = worker_config(parse("--partitions", "4", "--data-dir", "tier/data"))
    config.make_data_dir()
    config.make_data_dir()  # and found there the next time
    for made in (tmp_path / "tier", tmp_path / "tier/data"):
        assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700, made


@pytest.mark.parametrize("data_dir", ["taken", "taken/data"])
def test_a_data_dir_with_a_file_in_the_way_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data_dir: str
) -> None:
    (tmp_path / "taken").touch()
    assert main(["run", "--partitions", "4", "--data-dir", data_dir]) == 2
    error = capsys.readouterr().err
    assert f"--data-dir: taken is in the way of {data_dir}: it is not a directory" in error


def test_a_creds_file_needs_nkeys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "worker.creds").touch()
    monkeypatch.setitem(sys.modules, "nkeys", None)  # as if it were not installed

    with pytest.raises(ConfigError, match=r"^--nats-creds needs the nkeys package"):
        worker_config(parse("--nats-creds", "worker.creds"))


@pytest.mark.parametrize(
    ("argv", "environment", "error"),
    [
        (["--retry-interval", "soon"], {}, "argument --retry-interval: not a duration: 'soon'"),
        ([], {"KVHANDOFF_RETRY_INTERVAL": "soon"}, "argument --retry-interval: not a duration"),
        ([], {"KVHANDOFF_METRICS_PORT": "http"}, "argument --metrics-port: invalid int value"),
        (["--log-format", "xml"], {}, "argument --log-format: invalid choice: 'xml'"),
        (["--batch-size", "many"], {}, "argument --batch-size: invalid int value: 'many'"),
    ],
)
def test_unparseable_values_are_usage_errors(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    environment: dict[str, str],
    error: str,
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)

    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)

    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err


def test_run_with_an_invalid_setting_exits_2_before_connecting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    async def serve(config: WorkerConfig) -> int:
        raise AssertionError("the worker started with an invalid configuration")

    monkeypatch.setattr(run_command, "serve", serve)

    assert main(["run", "--nats-url", "http://x"]) == 2

    out, err = capsys.readouterr()
    assert err == "kvhandoff run: --nats-url: 'http://x' is not a nats://, tls://, ws:// URL\n"
    assert out == ""
    assert list(tmp_path.iterdir()) == []  # no event log was created either


def test_a_tier_priority_timeout_within_the_ack_wait_and_pull_expiry_exits_2_before_connecting(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The tier's timings are checked together (worker.tier.membership.TierSettings): a pin that
    lapses before the old owner's unacknowledged inputs are due again would let a new owner apply
    newer inputs first. Nothing listens at the URL: the worker must not get as far."""
    monkeypatch.chdir(tmp_path)
    flags = ["--partitions", "4", "--data-dir", ".", "--nats-url", "nats://127.0.0.1:9"]
    assert worker_config(parse(*flags, "--priority-timeout", "5s")).tier.priority_timeout_s == 5
    assert main(["run", *flags, "--priority-timeout", "2s", "--metrics-port", "0"]) == 2
    assert "--priority-timeout must be more than 2s" in capfd.readouterr().err


def test_the_ack_wait_is_the_input_consumers_and_the_priority_timeout_must_exceed_it(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--ack-wait` is what JetStream waits before it redelivers an input: the tier's
    consumers are made with it, and a longer one needs a longer priority timeout, checked
    before connecting (nothing listens at the URL)."""
    monkeypatch.chdir(tmp_path)
    flags = ["--nats-url", "nats://127.0.0.1:9", "--metrics-port", "0"]
    longer = worker_config(parse(*flags, "--ack-wait", "2s", "--priority-timeout", "5s"))
    assert tier_settings(longer).ack_wait_s == 2
    assert tier_settings(worker_config(parse(*flags))).ack_wait_s == 1
    assert main(["run", *flags, "--ack-wait", "3s"]) == 2
    assert "--priority-timeout must be more than 4s (--ack-wait plus" in capfd.readouterr().err


def test_kvhandoff_runs_defaults_are_the_tiers_and_its_help_says_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The tier's settings are `kvhandoff run`'s `TierConfig` (written once, in worker.config),
    so its defaults are the tier's; `--ack-wait`'s help must give the pull's expiry, which only
    `TierSettings` has (the client library imports worker.config for its NATS settings, and may
    not load the tier), that the check adds."""
    config = worker_config(parse())
    assert tier_settings(config) == TierSettings(partitions=1)
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    helps = " ".join(capsys.readouterr().out.split())
    assert f"exceed it by the pull's expiry, {TierSettings.pull_expires_s:g}s" in helps
