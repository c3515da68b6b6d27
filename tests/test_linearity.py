"""The linearity diagnostic (editing/linearity.py): d(α) against its closed form on a model
quadratic in θ; zero for the linearized regime's tangent model and not for the plain model it
linearizes; and the evaluate job's per-task departures on the tiny suite."""

import jax.numpy as jnp
import numpy as np
import pytest

from editing import linearity
from editing import regimes
from editing.errors import UserError
from editing.jobs import evaluate as evaluate_job
from editing.jobs import experiment
from editing.task_vector import TaskVector

RNG = np.random.default_rng(0)
ALPHAS = [0.5, 1.0, 2.0]


def test_departure_of_a_quadratic_model_has_its_closed_form():
  """f(θ) = x ⊙ θ²: f(θ0 + ατ) − f(θ0) − α·2θ0τx = α²τ²x, so d(α) = α‖τ²x‖ / ‖2θ0τx‖."""
  w0 = RNG.standard_normal(6).astype(np.float32)
  tau = RNG.standard_normal(6).astype(np.float32)
  x = RNG.standard_normal((10, 6)).astype(np.float32)
  encoder = lambda theta0, params, inputs: inputs * params['w']**2
  got = linearity.departures(encoder, {'w': w0}, TaskVector({'w': tau}, ('a',), 'full', ''),
                             x, ALPHAS, batch_size=4)
  expected = [a * np.linalg.norm(tau**2 * x) / np.linalg.norm(2 * w0 * tau * x) for a in ALPHAS]
  np.testing.assert_allclose(got, expected, rtol=1e-4)


def test_the_tangent_model_is_linear_and_the_plain_one_is_not():
  params = {'w1': RNG.standard_normal((5, 8)).astype(np.float32),
            'w2': RNG.standard_normal((8, 3)).astype(np.float32)}
  apply_fn = lambda p, x: jnp.tanh(x @ p['w1']) @ p['w2']
  tau = TaskVector({k: 0.5 * RNG.standard_normal(v.shape).astype(np.float32)
                    for k, v in params.items()}, ('a',), 'full', '')
  x = RNG.standard_normal((16, 5)).astype(np.float32)
  tangent = linearity.departures(regimes.get('linearized').encoder(apply_fn), params, tau, x,
                                 ALPHAS)
  plain = linearity.departures(regimes.get('full').encoder(apply_fn), params, tau, x, ALPHAS)
  assert max(tangent) < 1e-5
  assert min(plain) > 1e-2 and plain[-1] > plain[0]


def test_the_evaluate_job_reports_each_tasks_departure(tiny_run):
  config, workdir, _ = tiny_run
  config = config.copy_and_resolve_references()
  config.eval.update(linearity_alphas='0.5,2', linearity_size=8)
  exp = experiment.Experiment.load(config, workdir)
  vectors = exp.vectors('full')
  result = evaluate_job._linearity(exp, 'full', vectors, exp.data())  # pylint: disable=protected-access
  assert result['alphas'] == [0.5, 2.0] and result['departure'].keys() == set(exp.tasks)
  for values in result['departure'].values():
    assert len(values) == 2 and all(np.isfinite(values)) and min(values) > 0
  np.testing.assert_allclose(result['mean'], np.mean(list(result['departure'].values()), 0))
  config.eval.linearity_alphas = '1,-1'
  with pytest.raises(UserError, match="linearity_alphas = '1,-1'"):
    evaluate_job.linearity_alphas(config)
