"""`tatoeba_en_es`: the bundled English-Spanish corpus as a tfds dataset (no network).

Reads data/tatoeba_en_es.tsv.gz from this repository (Tatoeba, tatoeba.org, exported by
manythings.org on 2023-07-30; CC-BY 2.0 France; see data/README.md). Every example keeps
its attribution line. Splits are made by the English sentence (tsv.split_of), so the
several Spanish translations of one English sentence never straddle train and test.
"""

from __future__ import annotations

import hashlib
import pathlib

import tensorflow_datasets as tfds
from etils import epath

from transformer.data import tsv

CORPUS_PATH = pathlib.Path(__file__).resolve().parents[2] / "data" / "tatoeba_en_es.tsv.gz"
CORPUS_SHA256 = "37094ce44cd5b69551103262bb5bc2a7aada51301f9ad9f03481fac50167016d"


class TatoebaEnEs(tfds.core.GeneratorBasedBuilder):
  """Tatoeba English-Spanish sentence pairs; train / validation / test by English sentence."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "manythings.org export of 2023-07-30, split by English sentence."}

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # tfds guesses a builder's location from its top-level package; name this file directly.
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description="Tatoeba English-Spanish pairs (CC-BY 2.0 France, tatoeba.org).",
      features=tfds.features.FeaturesDict(
        {
          "en": tfds.features.Text(),
          "es": tfds.features.Text(),
          "attribution": tfds.features.Text(),
        }
      ),
      supervised_keys=("en", "es"),
      homepage="https://tatoeba.org",
      license="CC-BY 2.0 (France)",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # the corpus ships with the code
    path = str(CORPUS_PATH)
    if not CORPUS_PATH.exists():
      raise FileNotFoundError(f"bundled corpus missing (install from the repository): {path}")
    sha256 = hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()
    if sha256 != CORPUS_SHA256:
      raise ValueError(f"{path} has sha256 {sha256}, expected {CORPUS_SHA256}")
    contents = tsv.read_tsv(path)
    return {
      split: self._generate_examples(contents, indices)
      for split, indices in tsv.split_indices(contents.pairs).items()
    }

  def _generate_examples(self, contents: tsv.TsvContents, indices: list[int]):
    for i in indices:
      en, es = contents.pairs[i]
      yield contents.line_numbers[i], {"en": en, "es": es, "attribution": contents.extras[i]}
