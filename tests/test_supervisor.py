"""`make run` supervisor's pure parts: backoff, exit descriptions, the cause read from a child's log, and
the preflight checks of the model directory and ports."""

import json
import socket

import pytest

from scripts.run import check_model_dir, describe_exit, last_error, port_in_use, restart_delay, unresponsive_s

pytestmark = pytest.mark.unit


def test_restart_backoff_doubles_and_is_capped():
    assert [restart_delay(n) for n in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_exit_descriptions_name_the_signal():
    assert describe_exit(2) == "code 2"
    assert describe_exit(-9) == "code -9 (killed by SIGKILL)"
    assert describe_exit(70) == "code 70 (its event loop stalled: the service's watchdog ended it)"
    assert "bus self-check" in describe_exit(69)
    from libs.service.watchdog import EXIT_CODE
    assert EXIT_CODE == 70


def test_last_error_prefers_the_last_error_record_of_a_json_log(tmp_path):
    log = tmp_path / "decode.log"
    records = [{"level": "INFO", "msg": "state"},
               {"level": "ERROR", "msg": "service failed to start", "error": "cannot connect to NATS at nats://x"},
               {"level": "INFO", "msg": "state"}]
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert last_error(log) == "service failed to start: cannot connect to NATS at nats://x"
    tb = {"level": "ERROR", "msg": "background task failed", "exc": "Traceback ...\nOSError: [Errno 98] in use"}
    log.write_text(json.dumps(tb) + "\n")
    assert last_error(log) == "background task failed: OSError: [Errno 98] in use"
    log.write_text("windserve router: invalid RouterConfig: WINDSERVE_REGISTRY_TTL_S: not an int\n")
    assert last_error(log) == "windserve router: invalid RouterConfig: WINDSERVE_REGISTRY_TTL_S: not an int"
    assert last_error(tmp_path / "missing.log") == ""


def test_model_dir_check_names_what_is_missing(tmp_path):
    assert check_model_dir(str(tmp_path / "nope")) == f"model directory {tmp_path / 'nope'} does not exist"
    assert "has no config.json" in check_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    assert "is not readable JSON" in check_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert "no *.safetensors weights" in check_model_dir(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert check_model_dir(str(tmp_path)) is None
    assert "is not a directory" in check_model_dir(str(tmp_path / "config.json"))


def test_port_in_use_is_detected_and_a_free_port_is_not():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
    assert port_in_use("127.0.0.1", port) is None


def test_unresponsive_time_counts_from_the_last_answer_or_the_end_of_the_startup_grace():
    # started at 100, grace 10
    assert unresponsive_s(105, 100, None, 0.0, 10) == 0.0  # still starting
    assert unresponsive_s(125, 100, None, 0.0, 10) == 15.0  # never answered: from the end of its grace
    assert unresponsive_s(125, 100, 103.0, 0.0, 10) == 22.0  # answered once (it is up): from that answer
    assert unresponsive_s(125, 100, 120.0, 0.0, 10) == 5.0
    assert unresponsive_s(125, 100, None, None, 10) == 0.0  # the prober cannot reach NATS: nobody's fault
    assert unresponsive_s(125, 100, 103.0, 122.0, 10) == 3.0  # NATS reachable again since 122
