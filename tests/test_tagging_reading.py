"""A token-classification task's files (stages/tagging/reading.py): CoNLL, JSON lines and `datasets` folders,
IOB1 / IOB2 / BIOES read as IOB2 with the scheme recorded, a dangling I- repaired and counted, faults refused
in one line naming the file and line."""

import json

import pytest

from cram.stages import StageError
from cram.stages.tagging.reading import detect_scheme, read_task, to_iob2

WNUT = "@paul\tO\nvisits\tO\nNew\tB-location\nYork\tI-location\n\nThe\tB-creative-work\nHobbit\tI-creative-work\n"


def _folder(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def test_wnut_style_tab_separated_folder(tmp_path):
    test = "Bob\tB-person\nruns\tO\n"
    task = read_task(str(_folder(tmp_path, {"train.conll": WNUT, "dev.conll": test, "test.conll": test})), "t")
    assert task.splits["train"].words == [["@paul", "visits", "New", "York"], ["The", "Hobbit"]]
    assert task.splits["train"].tags[1] == ["B-creative-work", "I-creative-work"]
    assert task.labels == (
        "O",
        "B-creative-work",
        "I-creative-work",
        "B-location",
        "I-location",
        "B-person",
        "I-person",
    )
    assert task.scheme == "IOB2" and task.repaired == {"train": 0, "validation": 0, "test": 0} and not task.carved
    assert task.untrained() == ["person"]  # scored, as a miss wherever it occurs


def test_conll2003_style_space_columns_docstart_and_last_column(tmp_path):
    train = "-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n\nPeter NNP B-NP B-PER\n"
    task = read_task(str(_folder(tmp_path, {"Train.TXT": train, "valid.txt": train, "test.tsv": train})), "t")
    assert task.splits["test"].words == [["EU", "rejects"], ["Peter"]]
    assert task.splits["test"].tags == [["B-ORG", "O"], ["B-PER"]]
    assert task.splits["test"].where == [f"{tmp_path / 'test.tsv'}:3", f"{tmp_path / 'test.tsv'}:7"]


def test_iob1_and_bioes_normalised_and_recorded():
    iob1 = [["I-PER", "I-PER", "B-PER", "O", "I-LOC"]]
    assert detect_scheme(iob1) == "IOB1"
    assert to_iob2(iob1[0], "IOB1") == (["B-PER", "I-PER", "B-PER", "O", "B-LOC"], 0)
    bioes = [["B-PER", "E-PER", "S-LOC", "O", "B-ORG", "I-ORG", "E-ORG"]]
    assert detect_scheme(bioes) == "BIOES"
    assert to_iob2(bioes[0], "BIOES") == (["B-PER", "I-PER", "B-LOC", "O", "B-ORG", "I-ORG", "I-ORG"], 0)
    assert detect_scheme([["B-PER", "I-PER", "O"]]) == "IOB2"


def test_dangling_i_repaired_as_conlleval_and_counted(tmp_path):
    train = "a\tB-X\nb\tO\nc\tI-X\nd\tI-Y\n\n"  # I-X after O, I-Y after X: both start an entity
    folder = _folder(tmp_path, {"train.conll": train * 5, "test.conll": "a\tI-X\n"})
    task = read_task(str(folder), "t")
    assert task.scheme == "IOB2"
    assert task.splits["test"].tags == [["B-X"]]
    assert task.repaired == {"train": 10, "test": 1}  # by file: the carved validation's are the training file's


def test_no_validation_file_carves_one_from_train_never_test(tmp_path):
    sentences = "".join(f"w{i}\tB-X\nx\tO\n\n" for i in range(30))
    task = read_task(str(_folder(tmp_path, {"train.conll": sentences, "test.conll": "a\tB-X\n"})), "t")
    train, validation = task.splits["train"].words, task.splits["validation"].words
    assert task.carved and len(validation) == 3 and len(train) == 27
    assert not {tuple(s) for s in train} & {tuple(s) for s in validation}


def test_jsonl_and_saved_dataset_with_class_label_ids(tmp_path):
    import datasets

    rows = [{"tokens": ["Ann", "sings"], "tags": ["B-PER", "O"]}]
    jsonl = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "j").mkdir()
    files = {"train.jsonl": jsonl, "validation.jsonl": jsonl, "test.jsonl": jsonl}
    task = read_task(str(_folder(tmp_path / "j", files)), "t")
    assert task.splits["validation"].tags == [["B-PER", "O"]]
    features = datasets.Features(
        {
            "tokens": datasets.Sequence(datasets.Value("string")),
            "ner_tags": datasets.Sequence(datasets.ClassLabel(names=["O", "B-PER", "I-PER"])),
        }
    )
    data = datasets.Dataset.from_dict({"tokens": [["Ann", "Lee", "sings"]], "ner_tags": [[1, 2, 0]]}, features=features)
    datasets.DatasetDict({"train": data, "dev": data, "test": data}).save_to_disk(str(tmp_path / "saved"))
    task = read_task(str(tmp_path / "saved"), "t")
    assert task.splits["test"].tags == [["B-PER", "I-PER", "O"]] and task.labels == ("O", "B-PER", "I-PER")


@pytest.mark.parametrize(
    ("train", "test", "message"),
    [
        ("a\tB-X\n", "a\tB-X\nb\tQ-X\n", "test.conll:2: tag 'Q-X' is none of IOB1, IOB2 or BIOES's"),
        ("a\tB-X\n", "a\tB-X\nb\n", "test.conll:2: expected a token and its tag"),
        ("a\tB-X\n", "\n\n-DOCSTART-\tO\n", "test.conll: no sentences"),
        ("a\tO\n", "a\tO\n", "tags no entity (every tag is O)"),
        ("a\tB-X\n", None, "has no test file"),
    ],
)
def test_bad_conll_refused_naming_file_and_line(tmp_path, train, test, message):
    files = {"train.conll": train * 3} | ({"test.conll": test} if test is not None else {})
    with pytest.raises(StageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_task(str(_folder(tmp_path, files)), "evaluate.tasks[0]")


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"tokens": ["a", "b"], "tags": ["O"]}, "test.jsonl:1: record 1: 2 tokens but 1 tags"),
        ({"tokens": [], "tags": []}, "test.jsonl:1: record 1: an empty sentence"),
        ({"tokens": ["a"], "tags": ["B_X"]}, "test.jsonl:1: record 1: tag 'B_X' is none of"),
        ({"tokens": ["a"]}, "test.jsonl:1: record 1: expected lists 'tokens' and 'ner_tags'"),
        ({"tokens": [" "], "tags": ["O"]}, "test.jsonl:1: record 1: an empty or blank token"),
        ({"tokens": [3], "tags": ["O"]}, "holds int 3, not text"),
    ],
)
def test_bad_jsonl_refused_naming_file_and_line(tmp_path, record, message):
    train = json.dumps({"tokens": ["a"], "tags": ["B-X"]}) + "\n"
    folder = _folder(tmp_path, {"train.jsonl": train * 3, "test.jsonl": json.dumps(record) + "\n"})
    with pytest.raises(StageError, match=message):
        read_task(str(folder), "t")


def test_not_utf8_refused(tmp_path):
    (tmp_path / "train.conll").write_text("a\tB-X\n" * 3)
    (tmp_path / "test.conll").write_bytes(b"\xff\tO\n")
    with pytest.raises(StageError, match="test.conll: not UTF-8 text"):
        read_task(str(tmp_path), "t")


def test_a_bioes_folder_is_read_as_iob2_with_its_scheme_recorded(tmp_path):
    train = "Ann\tB-PER\nLee\tE-PER\nin\tO\nRome\tS-LOC\n\n"
    task = read_task(str(_folder(tmp_path, {"train.conll": train * 3, "test.conll": train})), "t")
    assert task.scheme == "BIOES" and task.splits["test"].tags == [["B-PER", "I-PER", "O", "B-LOC"]]
    assert task.labels == ("O", "B-LOC", "I-LOC", "B-PER", "I-PER")


def test_a_saved_dataset_with_string_tags(tmp_path):
    import datasets

    data = datasets.Dataset.from_dict({"tokens": [["Ann", "sings"], ["Bob"]], "tags": [["B-PER", "O"], ["I-PER"]]})
    datasets.DatasetDict({"train": data, "validation": data, "test": data}).save_to_disk(str(tmp_path / "saved"))
    task = read_task(str(tmp_path / "saved"), "t")
    assert task.splits["test"].tags == [["B-PER", "O"], ["B-PER"]] and task.repaired["test"] == 1
    bad = datasets.Dataset.from_dict({"tokens": [["Ann", "sings"]], "tags": [["B-PER"]]})
    datasets.DatasetDict({"train": data, "test": bad}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(StageError, match=r"bad/test: row 0: 2 tokens but 1 tags"):
        read_task(str(tmp_path / "bad"), "t")
