"""The data preflight check (run before Ray starts): each way a data path can be wrong gives one ConfigError
line naming the flag and the file; a good configuration gives the region file shares; and the check imports
neither ray nor torch nor transformers, so it costs well under a second."""

import gzip
import json
import subprocess
import sys

import pytest

from ray_diloco.config import ConfigError, DataConfig
from ray_diloco.data.files import (
    embedded_eval_path,
    embedded_train_dir,
    list_data_files,
    split_files_across_regions,
)
from ray_diloco.data.preflight import check_data, first_lines


def write_gz(path, lines):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def one_line_error(cfg, num_regions=1, seed=0):
    with pytest.raises(ConfigError) as error:
        check_data(cfg, num_regions, seed)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_the_embedded_sample_passes_and_gives_the_region_shares():
    files = list_data_files(embedded_train_dir())
    for num_regions, seed in [(1, 0), (3, 7), (8, 1)]:
        expected = split_files_across_regions(files, num_regions, seed)
        assert check_data(DataConfig(), num_regions, seed) == expected
        assert check_data(DataConfig(path=embedded_train_dir(), eval_path=embedded_eval_path()),
                          num_regions, seed) == expected


def test_a_path_that_does_not_exist_names_its_flag(tmp_path):
    assert one_line_error(DataConfig(path=str(tmp_path / "nope"))).startswith("--data: ")
    assert "does not exist" in one_line_error(DataConfig(path=str(tmp_path / "nope")))
    assert one_line_error(DataConfig(path=str(tmp_path / "*.json.gz"))).startswith("--data: no data files match")
    assert one_line_error(DataConfig(eval_path=str(tmp_path / "nope"))).startswith("--eval-data: ")


def test_files_without_a_text_field_name_the_file(tmp_path):
    no_text = write_gz(tmp_path / "a.json.gz", [json.dumps({"content": f"doc {i}"}) for i in range(30)])
    message = one_line_error(DataConfig(path=no_text))
    assert message == (f"--data: {no_text}: none of its first 20 records has a string 'text' field (20 skipped): "
                       "give files in the allenai/c4 json.gz layout (one {\"text\": ...} per line)")
    # The held-out files are checked the same way.
    assert one_line_error(DataConfig(eval_path=no_text)).startswith(f"--eval-data: {no_text}: none of its first 20")


def test_an_empty_file_is_called_empty(tmp_path):
    # Not "none of its first 0 records": an empty (or all-blank) file has no records to look at.
    for name, content in [("a.json.gz", gzip.compress(b"")), ("b.jsonl", b"\n \n")]:
        (tmp_path / name).write_bytes(content)
        message = one_line_error(DataConfig(path=str(tmp_path / name)))
        assert message == (f"--data: {tmp_path / name}: the file is empty (no records): give files in the "
                           "allenai/c4 json.gz layout (one {\"text\": ...} per line)")


def test_each_region_s_first_file_is_read(tmp_path):
    good = [json.dumps({"text": f"doc {i}"}) for i in range(5)]
    write_gz(tmp_path / "a.json.gz", good)
    (tmp_path / "b.jsonl").write_text("not json\n" * 3)  # plain text, not gzip: also read
    assert check_data(DataConfig(path=str(tmp_path / "a.json.gz")), 1, 0) == [[str(tmp_path / "a.json.gz")]]
    message = one_line_error(DataConfig(path=str(tmp_path)), num_regions=2)
    assert message.startswith(f"--data: {tmp_path / 'b.jsonl'}: none of its first 3 records")


def test_too_few_files_and_an_unreadable_file(tmp_path):
    path = write_gz(tmp_path / "a.json.gz", [json.dumps({"text": "doc"})])
    assert "use fewer regions" in one_line_error(DataConfig(path=path), num_regions=2)
    (tmp_path / "b.json.gz").write_bytes(b"this is not gzip data")
    message = one_line_error(DataConfig(path=str(tmp_path / "b.json.gz")))
    assert message.startswith(f"--data: {tmp_path / 'b.json.gz'}: cannot read it")


def test_a_streamed_hf_dataset_has_no_files_to_check(tmp_path):
    assert check_data(DataConfig(hf_dataset="allenai/c4"), 4, 0) == []
    assert one_line_error(DataConfig(hf_dataset="allenai/c4", eval_path=str(tmp_path / "nope"))).startswith(
        "--eval-data: ")


def test_first_lines_reads_only_the_start_and_keeps_a_last_line_without_newline(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(["x" * 200_000, "", "b", "c"]))  # a line longer than one read chunk
    assert first_lines(str(path), 2) == ["x" * 200_000, "b"]
    assert first_lines(str(path), 10) == ["x" * 200_000, "b", "c"]


def test_importing_the_check_imports_no_ray_torch_or_transformers():
    code = ("import sys, ray_diloco.data.preflight; "
            "print(sorted(m for m in ('ray', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
