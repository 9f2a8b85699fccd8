import json

import pytest

from tierkv.errors import ConfigError
from tierkv.schedule.documents import OutputLog, read_inputs, settings_digest


def test_jsonl_inputs_report_bad_lines_as_documents(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "text": "alpha"}\n\nnot json\n{"text": "no id"}\n[1]\n{"id": "a", "text": "x"}\n'
                    '{"id": "n", "text": 3}\n')
    docs = read_inputs(path)
    assert [(d.id, d.text, d.error) for d in docs] == [
        ("a", "alpha", None), ("3", None, "unreadable: line 3 is not JSON"), ("4", "no id", None),
        ("5", None, "unreadable: line 5 is not a JSON object"), ("a#line6", None, "duplicate id 'a'"),
        ("n", None, 'unreadable: no "text" string')]


def test_a_duplicate_is_named_apart_from_every_real_id(tmp_path):
    """A duplicate's made-up id (``x#line2``) used to collide with a real id spelled the same, and the
    real document was then flagged as a duplicate too."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "x", "text": "one"}\n{"id": "x", "text": "two"}\n{"id": "x#line2", "text": "three"}\n')
    docs = read_inputs(path)
    assert [(d.id, d.text, d.error) for d in docs] == [
        ("x", "one", None), ("x#line2#2", None, "duplicate id 'x'"), ("x#line2", "three", None)]


def test_a_jsonl_line_ends_at_a_newline_only_and_its_bytes_are_utf8_or_the_line_says_so(tmp_path):
    """U+2028 and its like are valid inside JSON text (written as they are by ensure_ascii=False): a
    line used to be cut there, its document lost and every later line numbered wrong. A line that is
    not UTF-8 used to run with its bytes replaced; a byte-order mark used to make the first line not JSON."""
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": "sep", "text": "a\u2028b\u2029c\x85d\x0ce"}, ensure_ascii=False).encode(),
             b'{"id": "latin1", "text": "Caf\xe9"}', b'{"id": "crlf", "text": "x"}\r', b'{"id": "last", "text": "z"}']
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n")
    docs = read_inputs(path)
    assert [(d.id, d.text, d.error) for d in docs] == [
        ("sep", "a\u2028b\u2029c\x85d\x0ce", None), ("2", None, "unreadable: line 2 is not UTF-8 text"),
        ("crlf", "x", None), ("last", "z", None)]


def test_directory_inputs_read_every_file_sorted(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "sub" / "a.md").write_text("ay")
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00bad")
    docs = read_inputs(tmp_path)
    assert [(d.id, d.text, d.error) for d in docs] == [
        ("b.txt", "bee", None), ("bin.dat", None, "unreadable: not UTF-8 text"), ("sub/a.md", "ay", None)]
    with pytest.raises(ConfigError, match="no such file or directory"):
        read_inputs(tmp_path / "missing")



def test_a_pipe_a_link_to_nothing_and_nul_bytes_in_a_folder_are_each_a_document_s_error(tmp_path):
    import os
    os.mkfifo(tmp_path / "pipe")                    # (read, it would wait for a writer for ever)
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "zeros.dat").write_bytes(bytes(2000))
    (tmp_path / "a.txt").write_text("ay")
    docs = {d.id: (d.text, d.error) for d in read_inputs(tmp_path)}
    assert docs == {"a.txt": ("ay", None), "zeros.dat": (None, "unreadable: binary (NUL bytes)"),
                    "pipe": (None, "unreadable: not a regular file (a pipe, a device, or a link to nothing)"),
                    "gone": (None, "unreadable: not a regular file (a pipe, a device, or a link to nothing)")}


def test_an_output_line_the_disk_has_no_room_for_names_the_file(tmp_path, monkeypatch):
    import errno
    import os

    from tierkv.errors import DiskFullError

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with OutputLog(tmp_path / "o.jsonl") as out:
        monkeypatch.setattr(os, "fsync", full)
        with pytest.raises(DiskFullError, match=f"--out {tmp_path / 'o.jsonl'}: No space left on device; the same "
                                                "command again goes on"):
            out.write({"id": "a", "summary": "x"})


def test_output_log_resumes_and_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "out.jsonl"
    with OutputLog(path) as log:
        log.write({"id": "a", "summary": "x"})
        log.write({"id": "b", "error": "empty document"})
    with open(path, "ab") as f:
        f.write(b'{"id": "c", "summ')                          # a write cut short by a kill
    with OutputLog(path) as log:
        assert log.done == {"a", "b"}
        log.write({"id": "c", "summary": "z"})
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "b", "c"]
    with pytest.raises(ConfigError, match="is a directory"):
        OutputLog(tmp_path)


def test_a_resume_with_other_settings_is_refused_and_the_file_left_as_it_was(tmp_path):
    path = tmp_path / "out.jsonl"
    first = {"--model": "smollm2", "--max-new-tokens": 64}
    with OutputLog(path, first) as log:
        log.write({"id": "a", "summary": "x"})
    with OutputLog(path, dict(first)) as log:           # the same settings: resumed
        assert log.done == {"a"}
        log.write({"id": "b", "summary": "y"})
    written = path.read_text()
    assert [json.loads(line)["job"] for line in written.splitlines()] == [settings_digest(first)] * 2
    with pytest.raises(ConfigError, match=r"line 1 was made with --max-new-tokens 64 where this run has 32; resume"):
        OutputLog(path, {"--model": "smollm2", "--max-new-tokens": 32})
    assert path.read_text() == written
    long = {"--instruction": "Summarize. " * 20}         # a long text: kept as its digest, and still compared
    with OutputLog(tmp_path / "long.jsonl", long) as log:
        log.write({"id": "a", "summary": "x"})
    assert json.loads((tmp_path / "long.jsonl").read_text())["settings"]["--instruction"].startswith("sha256:")
    with pytest.raises(ConfigError, match=r"made with --instruction 'sha256:.*' where this run has 'Summarize.'"):
        OutputLog(tmp_path / "long.jsonl", {"--instruction": "Summarize."})
    digest_only = tmp_path / "digest.jsonl"              # records that carry the digest alone: all settings shown
    digest_only.write_text(json.dumps({"id": "a", "summary": "x", "job": settings_digest(first)}) + "\n")
    with pytest.raises(ConfigError, match=r"settings other than this run's \(this run: .*--max-new-tokens 32"):
        OutputLog(digest_only, {"--model": "smollm2", "--max-new-tokens": 32})
    older = tmp_path / "older.jsonl"                     # records written before the digest: taken as they are
    older.write_text('{"id": "a", "summary": "x"}\n')
    with OutputLog(older, first) as log:
        assert log.done == {"a"}


def test_retry_failed_takes_out_the_lines_of_documents_that_failed_and_keeps_the_rest(tmp_path):
    path = tmp_path / "out.jsonl"
    with OutputLog(path) as log:
        log.write({"id": "a", "summary": "x"})
        log.write({"id": "b", "error": "failed: the worker running it died at every try"})
        log.write({"id": "c", "error": "empty document"})
    with open(path, "ab") as f:
        f.write(b'{"id": "d", "summ')                          # and a torn last line
    with OutputLog(path) as log:                               # without the flag: failed lines are done
        assert log.done == {"a", "b", "c"}
    with OutputLog(path, retry_failed=True) as log:
        assert log.done == {"a", "c"}
        log.write({"id": "b", "summary": "y"})
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "c", "b"]
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_an_output_file_of_another_kind_is_refused_and_left_as_it_was(tmp_path):
    """Only a torn last line is cut: a file whose other lines are no records (notes, an edited line) is
    not truncated to its first good lines."""
    notes = tmp_path / "notes.md"
    notes.write_text("# my notes\n\nkeep these\n")
    with pytest.raises(ConfigError, match="line 1 is not a record of tierkv batch"):
        OutputLog(notes)
    assert notes.read_text() == "# my notes\n\nkeep these\n"
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "summary": "x"}\nedited by hand\n{"id": "b", "summary": "y"}\n')
    with pytest.raises(ConfigError, match="line 2"):
        OutputLog(out)
    assert out.read_text().count("\n") == 3


def test_directory_inputs_skip_the_output_and_hidden_files_and_an_empty_one_is_named(tmp_path):
    docs_dir = tmp_path / "docs"
    (docs_dir / ".git").mkdir(parents=True)
    (docs_dir / ".git" / "HEAD").write_text("ref")
    (docs_dir / "a.txt").write_text("ay")
    (docs_dir / "summaries.jsonl").write_text('{"id": "a.txt", "summary": "x"}\n')
    docs = read_inputs(docs_dir, out=docs_dir / "summaries.jsonl")
    assert [d.id for d in docs] == ["a.txt"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no documents in it"):
        read_inputs(tmp_path / "empty")


def test_a_made_up_id_never_takes_a_line_s_own_and_an_id_is_a_string_or_a_number(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "first, no id"}\n{"id": "1", "text": "one"}\nnot json\n{"id": 3, "text": "three"}\n'
                    '{"id": null, "text": "nul"}\n{"id": [5], "text": "list"}\n')
    assert [(d.id, d.text, d.error) for d in read_inputs(path)] == [
        ("line1", "first, no id", None), ("1", "one", None), ("line3", None, "unreadable: line 3 is not JSON"),
        ("3", "three", None), ("5", None, 'unreadable: line 5\'s "id" is null: give a string or a number'),
        ("6", None, 'unreadable: line 6\'s "id" is [5]: give a string or a number')]
    path.write_text('{"id": "3", "text": "a"}\n{"text": "b"}\n{"text": "c"}\n{"id": "line3", "text": "d"}\n'
                    '{"id": 1.5, "text": "e"}\n')
    assert [(d.id, d.error) for d in read_inputs(path)] == [
        ("3", None), ("2", None), ("line3#2", None), ("line3", None), ("1.5", None)]


def test_an_empty_jsonl_and_an_out_that_is_the_inputs_or_a_list_of_documents_are_refused(tmp_path):
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n")
    with pytest.raises(ConfigError, match="no documents in it"):
        read_inputs(inputs)
    inputs.write_text('{"id": "a", "text": "alpha"}\n')
    with pytest.raises(ConfigError, match="is the --inputs file"):
        read_inputs(inputs, out=tmp_path / "." / "in.jsonl")
    with pytest.raises(ConfigError, match="line 1 is not a record of tierkv batch"):   # not "1 already done"
        OutputLog(inputs, {"--model": "smollm2"})
    assert inputs.read_text() == '{"id": "a", "text": "alpha"}\n'


def test_a_file_with_no_json_object_in_it_is_not_taken_for_jsonl(tmp_path):
    """A text file given as --inputs used to become one failed document a line, and the job exit 0."""
    path = tmp_path / "doc.txt"
    path.write_text("Once upon a time.\n{not json\n\n[1, 2]\n")
    with pytest.raises(ConfigError, match=r"doc.txt: not a .jsonl file \(no line of it is a JSON object\)"):
        read_inputs(path)
