"""benchmarks/scaling.py's fits on synthetic data with known parameters and noise: the robust fits recover them,
the bootstrap interval of an extrapolated prediction holds the true value, the frontier is the cheapest-best
runs, and the compute-optimal size matches the closed form of the two-term law."""
import numpy as np
import pytest

from benchmarks import scaling


def test_the_two_term_fit_recovers_known_parameters_from_noisy_runs():
    rng = np.random.default_rng(0)
    true = (0.02, 40.0, 0.45, 300.0, 0.55)  # e, A, alpha, B, beta
    n = np.repeat([2e4, 5e4, 1e5, 3e5, 8e5], 4)
    d = np.tile([4e3, 1e4, 3e4, 1e5], 5)
    err = scaling.two_term_law(n, d, *true) * np.exp(rng.normal(0, 0.02, n.size))  # 2% noise
    fitted = scaling.fit_two_term(n, d, err)
    # the exponents and the floor are what the data pin down (A and alpha trade off along a ridge)
    e, a, alpha, b, beta = fitted
    assert e == pytest.approx(true[0], abs=0.01) and alpha == pytest.approx(true[2], abs=0.1) and \
        beta == pytest.approx(true[4], abs=0.1), fitted
    np.testing.assert_allclose(scaling.two_term_law(n, d, *fitted), scaling.two_term_law(n, d, *true), rtol=0.05)
    held_n, held_d = 3e6, 1e5  # beyond every run's N: an extrapolation
    lo, hi, failed = scaling.bootstrap(scaling.fit_two_term, lambda p: scaling.two_term_law(held_n, held_d, *p),
                                       (n, d, err), resamples=40)
    assert lo <= scaling.two_term_law(held_n, held_d, *true) <= hi and failed < 10


def test_the_frontier_fit_recovers_known_parameters_and_an_outlier_does_not_pull_it():
    rng = np.random.default_rng(1)
    true = (5e3, 0.5, 0.03, 1e6)  # a, b, c, d
    c = np.logspace(8, 12, 12)
    err = scaling.frontier_law(c, *true) * np.exp(rng.normal(0, 0.02, c.size))
    err[5] *= 1.8  # one bad run: the soft-L1 loss keeps it from moving the fit
    a, b, cc, d = scaling.fit_frontier(c, err)
    assert b == pytest.approx(0.5, rel=0.1) and cc == pytest.approx(0.03, abs=0.01)
    assert scaling.frontier_law(1e13, a, b, cc, d) == pytest.approx(scaling.frontier_law(1e13, *true), rel=0.1)


def test_the_compute_frontier_and_the_compute_optimal_size():
    runs = [{"flops": 1, "error": 0.5}, {"flops": 2, "error": 0.6}, {"flops": 3, "error": 0.4},
            {"flops": 4, "error": 0.45}, {"flops": 5, "error": 0.3}]
    assert [r["flops"] for r in scaling.compute_frontier(runs)] == [1, 3, 5]
    e, a, alpha, b, beta, k = 0.0, 50.0, 0.4, 200.0, 0.6, 6.0
    budget = 1e15
    n, d = scaling.compute_optimal(np.array([e, a, alpha, b, beta]), budget, k)
    # d/dN [A N^-alpha + B (C/kN)^-beta] = 0  =>  N = (alpha A / (beta B))^(1/(alpha+beta)) (C/k)^(beta/(alpha+beta))
    closed = (alpha * a / (beta * b)) ** (1 / (alpha + beta)) * (budget / k) ** (beta / (alpha + beta))
    assert n == pytest.approx(closed, rel=0.01) and n * d * k == pytest.approx(budget, rel=1e-9)
