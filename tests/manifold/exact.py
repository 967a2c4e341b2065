"""Exact restricted laws on a circle and a sphere by numerical integration (scipy.integrate): the references of the
sampler tests. The density w.r.t. arc length / surface area is N(z; mu, Sigma) / |J| with |J| = 2 r constant, so on
the circle z = r (cos t, sin t) the law of t has density proportional to N(z(t); mu, Sigma) (arc length r dt), and
on the sphere z = r (sin u cos v, sin u sin v, cos u) the law of (u, v) proportional to N(z(u, v)) sin u."""

import numpy as np
import scipy.integrate as si


def circle_density(mu, sigma, r):
    mu, sigma = np.asarray(mu, float), np.asarray(sigma, float)

    def dens(t):
        return np.exp(-0.5 * (((r * np.cos(t) - mu[0]) / sigma[0]) ** 2 + ((r * np.sin(t) - mu[1]) / sigma[1]) ** 2))
    return dens


def circle_moments(mu, sigma, r):
    """``Z`` (of N(z)/|J| w.r.t. arc length, with the Gaussian's normaliser), ``E z`` and ``E z z^T``."""
    mu, sigma = np.asarray(mu, float), np.asarray(sigma, float)
    dens = circle_density(mu, sigma, r)
    raw = si.quad(dens, -np.pi, np.pi, epsabs=0, epsrel=1e-12, limit=200)[0]
    funcs = [lambda t: r * np.cos(t), lambda t: r * np.sin(t)]
    mean = np.array([si.quad(lambda t, f=f: f(t) * dens(t), -np.pi, np.pi, epsabs=0, epsrel=1e-12, limit=200)[0]
                     for f in funcs]) / raw
    second = np.array([[si.quad(lambda t, f=f, g=g: f(t) * g(t) * dens(t), -np.pi, np.pi, epsabs=0, epsrel=1e-12,
                                limit=200)[0] for g in funcs] for f in funcs]) / raw
    gauss_norm = 1.0 / (2 * np.pi * sigma[0] * sigma[1])
    Z = raw * r * gauss_norm / (2 * r)  # arc length r dt, density / |J| with |J| = 2 r
    return Z, mean, second


def circle_cdf(mu, sigma, r):
    """The CDF of the angle ``atan2(z_2, z_1)`` in (-pi, pi]."""
    dens = circle_density(mu, sigma, r)
    grid = np.linspace(-np.pi, np.pi, 4001)
    vals = dens(grid)
    cum = np.concatenate([[0.0], np.cumsum((vals[1:] + vals[:-1]) / 2 * np.diff(grid))])
    # refine: trapezoid on 4000 intervals of a smooth periodic function is exact to round-off (spectral accuracy)
    cum /= cum[-1]
    return lambda t: np.interp(t, grid, cum)


def sphere_moments(mu, sigma, r):
    """``E z`` and ``E z_i^2`` of the sphere law, by 2-D integration."""
    mu, sigma = np.asarray(mu, float), np.asarray(sigma, float)

    def point(u, v):
        return r * np.array([np.sin(u) * np.cos(v), np.sin(u) * np.sin(v), np.cos(u)])

    def dens(u, v):
        z = point(u, v)
        return np.exp(-0.5 * np.sum(((z - mu) / sigma) ** 2)) * np.sin(u)

    def integral(f):
        return si.dblquad(lambda v, u: f(u, v) * dens(u, v), 0, np.pi, 0, 2 * np.pi, epsabs=0, epsrel=1e-10)[0]
    raw = integral(lambda u, v: 1.0)
    mean = np.array([integral(lambda u, v, i=i: point(u, v)[i]) for i in range(3)]) / raw
    second = np.array([integral(lambda u, v, i=i: point(u, v)[i] ** 2) for i in range(3)]) / raw
    return mean, second
