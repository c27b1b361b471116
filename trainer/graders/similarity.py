"""``text_similarity`` metrics, each from the field's library (none hand-written), scaled to [0, 1]:

* ``fuzzy_match``: rapidfuzz ``fuzz.WRatio`` with ``utils.default_process`` (lower-cased, punctuation
  dropped) / 100: the best of rapidfuzz's ratio, partial and token-set/sort ratios, weighted.
* ``bleu``: sacrebleu ``sentence_bleu(input, [reference]).score / 100`` (Papineni et al. 2002, sacrebleu's
  default 13a tokenisation, exponential smoothing).
* ``gleu``: NLTK ``sentence_gleu([reference words], input words)`` (Wu et al. 2016, Google's GLEU: the
  minimum of n-gram precision and recall over 1..4-grams), on whitespace words.
* ``meteor``: NLTK ``meteor_score`` (Banerjee and Lavie 2005) on whitespace words. Its synonym stage reads
  NLTK's WordNet data; where that is not installed (``python -m nltk.downloader wordnet``; nothing is
  downloaded here), the exact and stem stages alone match words.
* ``rouge_1`` .. ``rouge_5``, ``rouge_l``: Google's ``rouge-score`` F-measure of ``rougeN`` / ``rougeL``
  (Lin 2004), reference first.
* ``cosine``: needs an embedding model, which this server does not configure: refused at submit.
"""

from __future__ import annotations

from functools import cache
from typing import Any

UNAVAILABLE = {
    "cosine": "evaluation_metric 'cosine' needs an embedding model, and this server configures none; "
    "use fuzzy_match, bleu, gleu, meteor or rouge_*"
}


class _NoSynonyms:
    """Stands in for NLTK's WordNet where its data is not installed: no word has synonyms."""

    @staticmethod
    def synsets(*_: Any, **__: Any) -> list[Any]:
        return []


@cache
def _wordnet() -> Any:
    import nltk

    try:
        nltk.data.find("corpora/wordnet")
    except LookupError:
        return _NoSynonyms()
    from nltk.corpus import wordnet

    return wordnet


@cache
def _rouge(metric: str) -> Any:
    from rouge_score import rouge_scorer

    key = "rougeL" if metric == "rouge_l" else f"rouge{metric[-1]}"
    return key, rouge_scorer.RougeScorer([key])


def similarity(metric: str, text: str, reference: str) -> float:
    """``text``'s similarity to ``reference`` by ``metric``, in [0, 1] (ValueError for cosine)."""
    if metric in UNAVAILABLE:
        raise ValueError(UNAVAILABLE[metric])
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz, utils

        return float(fuzz.WRatio(text, reference, processor=utils.default_process)) / 100.0
    if metric == "bleu":
        import sacrebleu

        return float(sacrebleu.sentence_bleu(text, [reference]).score) / 100.0
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return float(sentence_gleu([reference.split()], text.split()))
    if metric == "meteor":
        from nltk.translate.meteor_score import meteor_score

        return float(meteor_score([reference.split()], text.split(), wordnet=_wordnet()))
    if metric.startswith("rouge_"):
        key, scorer = _rouge(metric)
        return float(scorer.score(reference, text)[key].fmeasure)
    raise ValueError(f"unknown evaluation_metric {metric!r}")
