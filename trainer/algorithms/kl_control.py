"""KL-coefficient controllers: fixed, and Ziegler et al.'s adaptive (proportional) schedule.

These hold a little state (the current coefficient), so they are small classes. The registry maps a name to
a factory with one keyword call shape, ``KL_CONTROLLERS[name](init_coef=..., target=..., horizon=...)``, so
the loop never branches on the name; the fixed controller ignores ``target`` and ``horizon``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

from trainer.algorithms._registry import lookup


class KLController(Protocol):
    """The interface a loop uses: read ``value`` as the KL coefficient, then ``update`` once per step."""

    @property
    def value(self) -> float:
        """Current KL coefficient."""
        ...

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust the coefficient after a step whose measured KL was ``current_kl``."""
        ...


class FixedKL:
    """Constant KL coefficient.

    Args:
        coef: the coefficient, returned by ``value`` forever.

    Degenerate: ``update`` is a no-op.
    """

    def __init__(self, coef: float) -> None:
        self._value = coef

    @property
    def value(self) -> float:
        """Current KL coefficient (always ``coef``)."""
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""
        del current_kl, n_steps


class AdaptiveKL:
    """Proportional controller that steers the measured KL towards a target.

    Args:
        init_coef: initial coefficient beta_0 (> 0).
        target: target KL per sequence (> 0), in the same units as the ``current_kl`` passed to update.
        horizon: number of samples (or steps, in the units of ``n_steps``) over which the error is
            corrected (> 0).

    Formula: ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``.
    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", Sec. 2.2
        (adaptive KL, K_beta = 0.1 there, i.e. horizon = 10 with n_steps = 1); verl ``AdaptiveKLController``.
    Degenerate: KL == target leaves beta unchanged; the +-0.2 clip bounds each multiplicative change.

    Raises:
        ValueError: if ``target`` or ``horizon`` is not positive.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKL needs target > 0 and horizon > 0, got {target=} {horizon=}")
        self._value = init_coef
        self.target = target
        self.horizon = horizon

    @property
    def value(self) -> float:
        """Current KL coefficient."""
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta proportionally to the clipped relative KL error, scaled by ``n_steps / horizon``."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self._value *= 1.0 + error * n_steps / self.horizon


class KLControllerFactory(Protocol):
    """Registry call shape: build a controller from the three spec fields."""

    def __call__(self, *, init_coef: float, target: float, horizon: int) -> KLController:
        """Build a controller."""
        ...


def fixed(*, init_coef: float, target: float, horizon: int) -> KLController:
    """Build a ``FixedKL(init_coef)``; ``target`` and ``horizon`` are accepted for a uniform call and ignored.

    Args:
        init_coef: the constant coefficient.
        target: ignored.
        horizon: ignored.

    Returns:
        A ``FixedKL``.
    """
    del target, horizon
    return FixedKL(init_coef)


def adaptive(*, init_coef: float, target: float, horizon: int) -> KLController:
    """Build an ``AdaptiveKL(init_coef, target, horizon)`` (Ziegler et al. 2019, Sec. 2.2).

    Args:
        init_coef: initial coefficient.
        target: target KL (> 0).
        horizon: correction horizon (> 0).

    Returns:
        An ``AdaptiveKL``.

    Raises:
        ValueError: if ``target`` or ``horizon`` is not positive.
    """
    return AdaptiveKL(init_coef, target, horizon)


def get_kl_controller(name: str) -> KLControllerFactory:
    """Look up a KL-controller factory by registry name.

    Args:
        name: one of the keys of ``KL_CONTROLLERS``.

    Returns:
        ``factory(*, init_coef, target, horizon) -> KLController``.

    Raises:
        ValueError: if the name is unknown; the message lists the valid names.
    """
    return lookup(KL_CONTROLLERS, name, "KL controller")


KL_CONTROLLERS: Mapping[str, KLControllerFactory] = MappingProxyType(
    {
        "fixed": fixed,
        "adaptive": adaptive,
    }
)
