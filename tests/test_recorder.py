"""`serve --record DIR` (server/api/recorder.py): one line per answered request, rotated by
size, never a header or key, and a directory that cannot be written is a warning, never a
failed request."""
import json
import logging

from openai import OpenAI

from lockstep.server.api.app import create_app
from lockstep.server.api.recorder import FILE_NAME, Recorder
from lockstep.server.engine import Engine
from tests.http_server import running


def test_files_rotate_by_size_and_keep_a_bounded_number(tmp_path):
    recorder = Recorder(tmp_path, max_bytes=100, keep=2)
    for i in range(10):
        recorder.write({"i": i, "pad": "x" * 40})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [FILE_NAME, FILE_NAME + ".1", FILE_NAME + ".2"]
    newest = [json.loads(line)["i"] for line in (tmp_path / FILE_NAME).read_text().splitlines()]
    assert newest == [9]  # each line alone fills a file of 100 bytes
    assert recorder.written == 10


def test_a_directory_that_cannot_be_made_is_one_warning_and_serving_goes_on(embedded_model, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    engine = Engine(embedded_model, max_active=2).start()
    try:
        with caplog.at_level(logging.WARNING, logger="lockstep.record"):
            with running(create_app(engine, record_dir=str(blocker / "records"), api_keys=["sekrit-key"])) as url:
                client = OpenAI(base_url=url + "/v1", api_key="sekrit-key", max_retries=0, timeout=300)
                for _ in range(2):
                    answer = client.chat.completions.create(model="default", max_tokens=2,
                                                            messages=[{"role": "user", "content": "Hi"}])
                    assert answer.choices[0].finish_reason in ("stop", "length")
        warnings = [r for r in caplog.records if r.name == "lockstep.record"]
        assert len(warnings) == 1 and str(blocker) in warnings[0].getMessage()
        # and with a directory that works, what is written never holds the key
        with running(create_app(engine, record_dir=str(tmp_path / "ok"), api_keys=["sekrit-key"])) as url:
            client = OpenAI(base_url=url + "/v1", api_key="sekrit-key", max_retries=0, timeout=300)
            client.chat.completions.create(model="default", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        text = (tmp_path / "ok" / FILE_NAME).read_text()
        assert text.count("\n") == 1 and "sekrit" not in text
    finally:
        engine.stop()
