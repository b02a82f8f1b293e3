"""The dashboard's cost per refresh does not grow with the run: a refresh parses only the records appended to the
events stream since the previous one, and still sees a stream that was replaced or cut."""
import json
import os

from keras_scale.tensorboard_plugin import data


def _append(run, records):
    os.makedirs(os.path.join(run, data.STREAM_DIR), exist_ok=True)
    with open(os.path.join(run, data.STREAM_DIR, data.STREAM_NAME), "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _records(first, count):
    return [{"kind": "checkpoint", "step": i, "time": float(i)} for i in range(first, first + count)]


class CountingJson:
    def __init__(self):
        self.calls = 0

    def loads(self, text):
        self.calls += 1
        return json.loads(text)


def test_a_refresh_parses_only_the_new_records(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    _append(run, _records(0, 5000))
    counting = CountingJson()
    monkeypatch.setattr(data, "json", counting)
    assert [e["step"] for e in data.read_run_events(run)] == list(range(5000))
    assert counting.calls == 5000
    _append(run, _records(5000, 3))
    with open(os.path.join(run, data.STREAM_DIR, data.STREAM_NAME), "a") as f:
        f.write('{"kind": "nan", "st')  # a record still being written: read at the next refresh
    events = data.read_run_events(run)
    assert [e["step"] for e in events] == list(range(5003))
    assert counting.calls == 5003
    events[0]["step"] = -1  # callers may change what they get: the next refresh is unaffected
    with open(os.path.join(run, data.STREAM_DIR, data.STREAM_NAME), "a") as f:
        f.write('ep": 7, "time": 9999.0}\n')
    events = data.read_run_events(run)
    assert events[0]["step"] == 0 and events[-1] == {"kind": "nan", "step": 8, "updates": 7, "time": 9999.0}
    assert counting.calls == 5004


def test_a_replaced_or_cut_stream_is_read_again(tmp_path):
    run = str(tmp_path / "run")
    path = os.path.join(run, data.STREAM_DIR, data.STREAM_NAME)
    _append(run, _records(0, 10))
    assert len(data.read_run_events(run)) == 10
    os.replace(_write_other(tmp_path, _records(100, 4)), path)  # a new run in the same directory
    assert [e["step"] for e in data.read_run_events(run)] == [100, 101, 102, 103]
    with open(path, "r+") as f:  # cut to its first record
        f.truncate(len(json.dumps(_records(100, 1)[0])) + 1)
    assert [e["step"] for e in data.read_run_events(run)] == [100]


def _write_other(tmp_path, records):
    other = str(tmp_path / "other.jsonl")
    with open(other, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return other
