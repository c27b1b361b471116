"""pass@k: the chance that at least one of k samples is correct, estimated from n >= k samples.

Pure Python (no torch): eval runs call it once per prompt and k, and average over prompts (Chen et al.
2021, eq. 1: the expectation over problems; trainer/loops/evaluate.py's ``EvalTally``).
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k for one problem with ``c`` correct among ``n`` samples.

    Formula: ``pass@k = 1 - C(n - c, k) / C(n, k)``: one minus the chance that k samples drawn without
    replacement from the n are all wrong. Computed as ``1 - prod_{i = n-c+1}^{n} (1 - k / i)``, which
    avoids the huge binomials (the two are equal: C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (i - k) / i).
    Source: Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1 and Fig. 3.
    Degenerate: ``n - c < k`` (fewer wrong samples than k) -> 1.0; ``c == 0`` -> 0.0.

    Returns:
        The estimate, in [0, 1].

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong

