"""`launch.prepare_data`: text files -> the launcher's ArrayRecord token files, with the bytes or
a tokenizer.json; the launcher trains on them and refuses a vocabulary too small for them."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from launch.data import batch_view as batch, loader as data_lib
from launch.run import trainer
from tests.helpers import ROOT, TINY, TINY_FLAGS, settings_of, tiny_config

TEXTS = {"b.txt": "the router sends each token to two experts.\n" * 40,
         "a.txt": "experts compute; the buffer holds the rows.\n" * 40,
         "c.md": "not matched by the glob"}


def prepare(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "launch.prepare_data", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def _records(folder) -> list[np.ndarray]:
  """The int32 records of `folder`'s token files, in sorted path order."""
  # Imported here, as the launcher does: collecting the suite (`make test-tpu` collects every
  # module) needs no ArrayRecord reader.
  from array_record.python.array_record_data_source import ArrayRecordDataSource
  source = ArrayRecordDataSource(sorted(str(p) for p in folder.glob("*.array_record")))
  return [np.frombuffer(source[i], "<i4") for i in range(len(source))]


@pytest.fixture
def texts(tmp_path):
  folder = tmp_path / "text"
  folder.mkdir()
  for name, text in TEXTS.items():
    (folder / name).write_text(text)
  return folder


def test_bytes_one_record_per_file_in_path_order(texts, tmp_path):
  done = prepare(f"--input={texts}/*.txt", f"--output={tmp_path / 'tokens'}", "--shards=2")
  assert done.returncode == 0, done.stderr
  records = _records(tmp_path / "tokens")
  expected = [np.frombuffer(TEXTS[n].encode(), np.uint8).astype("<i4") for n in ("a.txt", "b.txt")]
  assert len(records) == 2
  for got, want in zip(records, expected):
    np.testing.assert_array_equal(got, want)
  with open(tmp_path / "tokens" / "prepare_data.json") as f:
    metadata = json.load(f)
  files = [{"path": str(texts / name), "shard": f"tokens-0000{i}-of-00002.array_record",
            "record": 0, "tokens": len(want)}
           for i, (name, want) in enumerate(zip(("a.txt", "b.txt"), expected))]
  assert metadata == {"tokenizer": "bytes", "vocab_size": 256, "shards": 2, "records": 2,
                      "tokens": sum(map(len, expected)), "largest_id": int(max(map(max, expected))),
                      "files": files, "inputs": 2}
  assert done.stdout.strip().endswith("--config.vocab_size=256")
  # The progress, captured (not a terminal): whole lines, no carriage return.
  assert "prepare_data: 2/2 files, " in done.stderr and "\r" not in done.stderr
  # What the launcher's array_record source reads: the records, concatenated in order.
  config = tiny_config()
  config.data.update(source="array_record", pattern=str(tmp_path / "tokens" / "*.array_record"))
  data = data_lib.make_data(config)
  stream = np.concatenate(expected)
  width = config.data.seq_len + 1
  for row, where in zip(data.global_batch(0), data.position(0)["rows"]):
    np.testing.assert_array_equal(row, stream[where["window"] * width:][:width])
  # launch.batch names each row's input file and offset in it, and shows its text, read here
  # from the input file itself.
  shown_as = batch.source(config, ids=False)
  lines = batch.describe(data.position(0), data.global_batch(0), 0, 20, shown_as)
  for line, where in zip(lines[1:], data.position(0)["rows"]):
    name = ("a.txt", "b.txt")[where["record"]]
    head = TEXTS[name].encode()[where["offset"]:][:20].decode()
    assert line == (f"row {lines.index(line) - 1}: {texts / name} token {where['offset']} "
                    f"(record {where['record']}) (window {where['window']}): {head!r}"), line
  ids = batch.describe(data.position(0), data.global_batch(0), 1, 4,
                       batch.source(config, ids=True))[1]
  assert ids.endswith(": " + " ".join(map(str, data.global_batch(0)[0, :4])))
  # A pattern that also matches the metadata is one line naming that file.
  config.data.pattern = str(tmp_path / "tokens" / "*")
  with pytest.raises(ValueError) as refused:
    data_lib.make_data(config)
  assert str(refused.value) == (
      f"config.data.pattern='{tmp_path / 'tokens' / '*'}' matches "
      f"{tmp_path / 'tokens' / 'prepare_data.json'}, which is not an ArrayRecord token file: "
      f"narrow the pattern, e.g. '{tmp_path / 'tokens' / '*.array_record'}'.")


def _tokenizer_file(path, texts) -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train([str(p) for p in sorted(texts.glob("*.txt"))],
            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
  tok.save(str(path))
  return tok


def test_a_tokenizer_json_and_a_vocabulary_the_launcher_checks(texts, tmp_path):
  """With a tokenizer.json the records are its ids; a launcher config whose vocab_size is
  smaller than the tokenizer's is refused in one line (exit 1) before anything compiles."""
  tok = _tokenizer_file(tmp_path / "tokenizer.json", texts)
  done = prepare(f"--input={texts}/*.txt", f"--output={tmp_path / 'tokens'}",
                 f"--tokenizer={tmp_path / 'tokenizer.json'}")
  assert done.returncode == 0, done.stderr
  [a, b] = _records(tmp_path / "tokens")
  np.testing.assert_array_equal(a, tok.encode(TEXTS["a.txt"]).ids)
  np.testing.assert_array_equal(b, tok.encode(TEXTS["b.txt"]).ids)
  vocab = tok.get_vocab_size()
  train = subprocess.run(
      [sys.executable, "-m", "launch.train", f"--workdir={tmp_path / 'run'}", f"--config={TINY}",
       *TINY_FLAGS, "--config.data.source=array_record",
       f"--config.data.pattern={tmp_path / 'tokens'}/*.array_record", "--config.vocab_size=8"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert train.returncode == 1
  assert train.stderr.splitlines()[-1] == (
      f"launch.train: error: {tmp_path / 'tokens'} holds tokens of a vocabulary of {vocab} ids "
      f"(tokenizer {tmp_path / 'tokenizer.json'}); config.vocab_size=8 is smaller: pass "
      f"--config.vocab_size={vocab}.")
  assert "compiling" not in train.stdout


@pytest.mark.parametrize("args,message", [
    (("--input={tmp}/none/*.txt",), "--input='{tmp}/none/*.txt' matches no file."),
    (("--tokenizer={tmp}/missing.json",), "--tokenizer={tmp}/missing.json: no such file"),
    (("--tokenizer={tmp}/text/a.txt",), "--tokenizer={tmp}/text/a.txt: not a tokenizer.json"),
    (("--shards=0",), "--shards=0 must be >= 1."),
])
def test_bad_input_is_one_line(texts, tmp_path, args, message):
  flags = {"input": f"--input={texts}/*.txt", "output": f"--output={tmp_path / 'out'}"}
  for arg in args:
    flags[arg.split("=")[0].lstrip("-")] = arg.format(tmp=tmp_path)
  done = prepare(*flags.values())
  assert done.returncode == 1 and "Traceback" not in done.stderr
  assert done.stderr.splitlines()[-1].startswith(
      "launch.prepare_data: error: " + message.format(tmp=tmp_path)), done.stderr


@pytest.mark.slow
def test_the_launcher_trains_on_prepared_tokens(texts, tmp_path):
  done = prepare(f"--input={texts}/*.txt", f"--output={tmp_path / 'tokens'}")
  assert done.returncode == 0, done.stderr
  config = tiny_config(train_steps=4, eval_every=4, checkpoint_every=4)
  config.data.update(source="array_record", pattern=str(tmp_path / "tokens" / "*.array_record"))
  losses = trainer.train_and_evaluate(settings_of(config), str(tmp_path / "run"))
  assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert "4" in os.listdir(tmp_path / "run" / "checkpoints")
