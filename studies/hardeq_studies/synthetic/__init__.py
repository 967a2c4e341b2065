r"""Study ``synthetic``: how good is each gradient estimator? (Gaussian and Poisson, L1 and L2.)

Reproduces the source paper's synthetic comparison of gradient estimators (its figure comparing the
estimators for the L1 and L2 losses on Gaussian variables, and the Poisson counterpart of its appendix
"Beyond Gaussian"), with a protocol that is stated in full here and recorded with the results
(``config.json`` of this package, copied into ``OUT/synthetic.json``).

Protocol
--------
*Parameter sets.* ``n_sets`` independent sets (20 with the ``cpu`` and ``paper`` presets, 4 with ``quick``;
``--seeds S``
overrides), all in float64:

* **Gaussian**, ``n = 10``, diagonal covariance: ``loc_i ~ N(0, 1)``, ``log_scale_i ~ U(log 1/2, log 2)``
  (``scale = exp(log_scale)``). Two constraint cases: ``sum`` -- one sum constraint ``1^T z = k``
  (:class:`hardeq.SumConstraint`); ``dense`` -- ``a = 3`` constraints with ``A_ij ~ N(0, 1)``
  (:class:`hardeq.LinearConstraint`). Target ``y ~ N(0, I_n)`` and ``k = A y``: ``y`` is then an exact
  draw of ``N(0, I)`` conditioned on ``A y = k`` (with ``k`` drawn from its marginal ``N(0, A A^T)``).
* **Poisson**, ``n = 10``: ``log_rate_i ~ N(0, 1)``, one sum constraint with the integer total ``k = 20``;
  target ``y ~ Multinomial(20, uniform)``, i.e. iid Poissons conditioned on ``sum(y) = 20``.

*Estimates.* For each set, ``N`` estimates (10,000 with ``cpu`` / ``paper``, 1,000 with ``quick``;
``--estimates`` overrides) ``h_i = grad_theta l(z_i)``, ``z_i`` one exact sample and ``l`` the summed
L1 (``sum_j |z_j - y_j|``) or L2 (``sum_j (z_j - y_j)^2``) loss, differentiated through the estimator.
``torch.abs`` has derivative 0 at 0: it matters for the Poisson L1 loss, where ``z_j = y_j`` has
positive probability (the closed form's derivative is the derivative of the expectation, whatever
subgradient the samples use). All ``N`` estimates of all sets in a chunk come from **one batched call**:
the parameters are expanded to per-sample leaves of shape ``(sets, N, n)``, the distribution gets batch
shape ``(sets, N)``, one sample is drawn per batch element, the per-sample losses are summed and
differentiated once; row ``(s, i)`` of the leaves' gradient is ``h_i`` of set ``s``.

*Common random numbers.* Within a family and constraint case every estimator sees the same parameter
sets, the same forward samples (the same noise ``eps``: all estimators share the forward pass) and, for
the variants that need one, the same independent proxy noise ``eps'``; L1 and L2 use the same draws.
Differences between estimators are therefore paired, not sampling noise between runs. Every estimator
call starts by reseeding torch's global generator from ``(seed, family, case, chunk)``: the Poisson forward
samples (drawn there by ``ConstrainedPoisson.rsample``) are shared too, the ``random`` estimator draws its
noise there, and results do not depend on the order of the blocks (``--resume``).

*Estimators.* Gaussian: every estimator registered for the ``"normal"`` family
(:func:`hardeq.estimators.available_estimators`) -- ``pathwise``, ``marginal_expectation``,
``constrained_marginal``, ``unconstrained_marginal``, ``constrained_layer`` (the constraint layer applied
to the reparameterised unconstrained sample built from the *same* noise as the forward sample),
``constrained_reparam_independent`` (a pathwise Matheron proxy from *independent* noise ``eps'``),
``random`` -- plus ``constrained_layer_independent``: ``constrained_layer`` with ``proxy_noise = eps'``
(independent noise, as in the paper's table). Poisson: every estimator registered for ``"poisson"``
(``marginal_expectation``, ``constrained_marginal``, ``unconstrained_marginal``, ``random``).

*Gradient targets.* Gaussian: ``loc`` (w.r.t. the means only, ``d = n``) and ``loc+log_scale`` (w.r.t.
means and log-scales together, concatenated, ``d = 2n``); both come from the same backward pass.
Poisson: ``log_rate`` (``d = n``).

*Ground truth.* ``h_gt = grad_theta sum_j E l_j``, autograd of the closed-form expected loss
(``expected_l1`` / ``expected_l2``, summed over coordinates) of the same parameter set.

*Metrics* (``cos`` = cosine similarity; ``cos(u, v) = 0`` when ``u`` or ``v`` is exactly zero, so a zero
estimate counts as uninformative; the fraction of exactly-zero estimates is reported as ``zero_fraction``):

* ``bias = 1 - cos(mean_i h_i, h_gt)``;
* ``variance = var_i(1 - cos(h_i, mean_j h_j))`` (unbiased, ``N - 1`` in the denominator);
* ``average_error = mean_i(1 - cos(h_i, h_gt))``;
* ``bias_ratio = N ||mean_i h_i - h_gt||^2 / sum_j var_i(h_ij)``: a Monte Carlo test of unbiasedness.
  ``E||mean - h_gt||^2 = tr Cov(h) / N`` exactly when ``E h = h_gt``, so the ratio is about 1 for an unbiased
  estimator (a weighted chi-square over its mean: between 0 and a few) and grows like ``N`` for a biased
  one. The cosine ``bias`` of an *unbiased* estimator is not 0 but ``O(1/N)`` (Monte Carlo noise in the
  mean); this column tells the two apart. (0 / 0 -- a constant estimate equal to the truth -- counts as 0;
  a constant estimate different from it as ``inf``.)

Each metric is computed per parameter set; the records hold the mean and the standard deviation
(``N - 1`` denominator) over the sets, and the per-set values.

Caveat on the ``random`` reference: the direction of the mean of ``N`` isotropic random vectors is
uniform *for every* ``N``, so its ``bias`` stays ``1 +- 1/sqrt(d)`` per set (it does not shrink with ``N``);
only its ``average_error`` concentrates at 1 as ``N`` grows (``+- 1/sqrt(dN)``).

Outputs: ``OUT/synthetic.json`` (records keyed by ``family``, ``case``, ``loss``, ``target``,
``method``/``estimator``, ``metric`` with ``mean``, ``std``, ``n_sets``; also ``dataset`` = ``family/case`` and
``n_seeds`` = ``n_sets``, the shared record keys of :mod:`hardeq_studies.results`),
``OUT/synthetic.md`` and one grouped bar chart per family and loss, ``OUT/synthetic_{family}_{loss}.png``.

Modules: :mod:`.data` (settings, estimator list, parameter sets), :mod:`.task` (estimates, ground truth,
metrics), :mod:`.run` (the blocks, resumable), :mod:`.report` (tables, figures), :mod:`.study` (the CLI contract).
"""
