"""What a shard does about stale gradients: delay compensation (DC-ASGD-a) and asynchrony-aware momentum.

A push carries the version its gradient was computed from; by the time it arrives the shard has
moved on ``staleness`` versions. ``staleness_compensation`` picks the remedy:

``none``
    Apply the gradient as it came.
``lr``
    Scale the step by 1/max(1, staleness) (the shard passes ``lr_scale``; nothing here).
``dc``
    Delay-compensated ASGD, the adaptive variant (:class:`DelayCompensation`).

``async_momentum = "auto"`` lowers the optimizer's momentum by what asynchrony adds on its own
(:func:`implicit_momentum`). Both act in async and ssp only: in sync every gradient of a round is
computed from the version it is applied to.
"""

from __future__ import annotations

import numpy as np

COMPENSATIONS = ("none", "lr", "dc")
ASYNC_MOMENTUM = ("off", "auto")
DC_EPS = 1e-7  # keeps lambda finite where the mean square is still 0 (the term it scales is 0 there too)


def implicit_momentum(workers: int) -> float:
    """The momentum that ``workers`` asynchronous workers add by themselves: 1 - 1/W.

    Mitliagkas, Zhang, Hadjis and Ré, "Asynchrony begets momentum, with an application to deep
    learning" (Allerton 2016), show that with W workers whose staleness is spread evenly, asynchronous
    SGD behaves in expectation like momentum SGD with momentum 1 - 1/W, so the explicit momentum must
    be lowered by that much to keep the total where it was tuned.
    """
    return 1.0 - 1.0 / max(1, workers)


def effective_momentum(momentum: float, workers: int) -> float:
    """The explicit momentum a shard applies with ``workers`` live asynchronous workers: max(0, mu - (1 - 1/W))."""
    return max(0.0, momentum - implicit_momentum(workers))


class DelayCompensation:
    """DC-ASGD-a: a stale gradient corrected by a first-order Taylor term, with an adaptive lambda.

    Zheng, Meng, Wang, Chen, Yu, Ma and Liu, "Asynchronous Stochastic Gradient Descent with Delay
    Compensation" (ICML 2017). A gradient ``g`` computed at ``w_pulled`` and applied at ``w_now``
    is, to first order, ``g + H (w_now - w_pulled)``; the paper approximates the Hessian ``H`` by
    the diagonal of the gradient's outer product (for cross-entropy losses its expectation is the
    Fisher information, an approximation of H), times ``lambda``, which trades that approximation's
    bias against its variance. So the shard applies::

        g_dc = g + lambda_t * g * g * (w_now - w_pulled)          (elementwise)

    The adaptive variant (DC-ASGD-a, their Algorithm 1 with lambda_t) divides by a moving mean
    square of the gradients, elementwise, so that lambda adapts to each weight's scale::

        m_t = beta * m_{t-1} + (1 - beta) * g * g
        lambda_t = lambda0 / sqrt(m_t + eps)

    with lambda0 = 2 and beta (their "momentum" of MeanSquare) = 0.95 in their experiments. The
    mean square takes every applied gradient, also those it cannot compensate. At staleness 0
    (``w_now == w_pulled``) ``g_dc`` is ``g`` exactly, so dc is plain SGD there.

    The corrected gradient is written block by block just before the optimizer reads the same
    block (:meth:`blocks` wraps the optimizer's block walk), so it adds one read of ``w_pulled``
    and of the mean square and one write of each per update, in cache, and no pass of its own.

    Parameters
    ----------
    size : int
        Elements of the shard's range.
    lambda0 : float
        Lambda before the adaptive scaling, > 0.
    beta : float
        Decay of the gradients' mean square, in [0, 1).
    """

    def __init__(self, size: int, lambda0: float = 2.0, beta: float = 0.95):
        self.lambda0 = float(lambda0)
        self.beta = float(beta)
        self.mean_square = np.zeros(size, np.float32)
        self.compensated = np.empty(size, np.float32)  # g_dc, what the optimizer reads in place of g

    def blocks(self, blocks, grad: np.ndarray, now: np.ndarray, pulled: np.ndarray | None):
        """The optimizer's blocks ``(slice, t, u)``, each after ``compensated[slice]`` holds g_dc.

        ``t`` and ``u`` are the optimizer's scratch for the block, free until it is yielded.
        ``pulled`` None: the version the gradient came from is gone; ``g`` goes on unchanged.
        """
        beta, lambda0, m_all, out = self.beta, self.lambda0, self.mean_square, self.compensated
        for block in blocks:
            s, t, u = block
            g, m = grad[s], m_all[s]
            np.multiply(g, g, out=t)
            m *= beta
            np.multiply(t, 1.0 - beta, out=u)
            m += u
            if pulled is None:
                np.copyto(out[s], g)
            else:
                np.add(m, DC_EPS, out=u)
                np.sqrt(u, out=u)
                np.divide(t, u, out=t)
                t *= lambda0
                np.subtract(now[s], pulled[s], out=u)
                t *= u
                np.add(g, t, out=out[s])
            yield block
