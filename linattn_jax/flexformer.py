"""Flexformer: learnable spectral random Fourier features (seed 000), linear attention through
the shared core (`core.attend_features`) with features of the scaled inputs ``x^ = x d^(-1/4)``
(trigonometric as written below, or positive: "Feature kinds"). The math as implemented, the
measurements behind every default and the departures from the paper are in docs/flexformer.md
("The mechanisms as implemented").

``flexformer_s`` (stationary, Bochner): learnable frequencies ``Omega [H, M, d]`` (init
``N(0, 1)``) and a per-head temperature ``a = exp(params["log_scale"])`` (init 1)::

    phi(x)  = M^(-1/2) [cos(Omega a x^); sin(Omega a x^)]          [2M features]
    phi~(x) = exp(|a x^|^2 / 2) phi(x)

so at init ``E[phi~(q) . phi~(k)] = exp(q^ . k^)``, the unbiased random-Fourier-feature
estimator of the softmax kernel; training moves the spectral density.

``flexformer_n`` (non-stationary, Yaglom): frequency pairs ``Omega1, Omega2 [H, M, d]`` and a
scale ``tau [H]`` (init ``log(2 sqrt d)``)::

    phi_n(x) = (4M)^(-1/2) [cos(Omega1 y) + cos(Omega2 y); sin(Omega1 y) + sin(Omega2 y)]
    phi~(x)  = exp(|x|^2 / exp(tau)) phi_n(x)

an explicit inner product, non-stationary once ``Omega1 != Omega2`` (init: ``Omega2 = Omega1 +
0.1 N(0, I)``, `init_n`). The paper gives the form, not this sum-of-pairs layout (ours).
With ``qk_radius`` set, ``tau`` is tied to the temperature, ``a^2 = 2 sqrt d / exp(tau)``.

Parameterisation: the frequencies are stored as ``omega_tilde = Omega / c`` (``"omega_tilde"``;
``"omega1_tilde"``, ``"omega2_tilde"``), so that Adam's relative steps on them are ``c`` times
larger; ``Omega`` and the kernel at init do not depend on ``c``. Config ``freq_scale`` (the
same for init and attention) sets ``c``; by default (`freq_scale_of`) flexformer_n stores at
``c = sqrt(H d)``, the init scale of a Dense kernel of fan-in ``H d`` (H heads of width d:
the model width), where its default positive features move their frequencies more than 10% in
the main job with no negative weight; flexformer_s at ``c = sqrt(d)``, as its default
trigonometric map turns its weights negative when moved further (docs/flexformer.md,
"Parameterisation"). The default is a function of the variant and the param shapes, so a
params tree alone gives ``Omega``: `frequencies` returns it; `from_direct_params` converts
params that stored ``Omega`` itself (``"omega"``, ``"omega1"``, ``"omega2"``: refused
otherwise).

Stability (defaults): ``qk_radius=1.0`` rescales q, k to ``|x^| = qk_radius`` before the map
(the kernel is then ``exp(a^2 qk_radius^2 cos(q, k))``), and ``den_floor=0.05`` is the core's
relative denominator floor (every weight row's l1 norm <= ``1 / den_floor``; rows above it
unchanged bit for bit). ``qk_radius=None, den_floor=0`` is the seed's raw map. The norm
factor is never formed: dropped for queries (it cancels), the core's detached
``key_log_scale`` for keys (the running maximum when causal).

Feature kinds (`DEFAULT_FEATURES`): ``features="positive"`` replaces the trigonometric map by
FAVOR+'s positive features of the same learned frequencies (`linattn_jax.flexformer_positive`;
flexformer_n's pair summed as its trigonometric map sums it): the same kernel at init, M
features, every weight positive, so no floor. It is **flexformer_n's default**, a departure
from the paper's trigonometric map (``features="trig"``), because it trained better than the
trigonometric pair on both equal-budget tasks by the claims' rule (docs/flexformer-ablations.md);
flexformer_s keeps the paper's map by default (its positive form was not measured there).

Options: ``learn_frequencies=False`` freezes the frequencies (the fixed-kernel RFF
estimator; the temperature stays learnable);
``init_method="orthogonal"`` draws orthogonal blocks (`performer.orthogonal_features`);
``pair_init`` / ``pair_jitter`` set ``Omega2`` (`init_n`); ``init_scale`` multiplies the
draw; ``learn_bandwidth=True`` adds a per-dimension bandwidth ``params["log_bandwidth"]
[H, d]``. Both mechanisms are deterministic: ``rng`` and ``deterministic`` are ignored.

Helpers for inspection and distillation: `feature_map_s` / `feature_map_n` (the stabilised
features), `kernel` (the unstabilised estimate), `trig_kernel`, `shift_invariance_gap`,
`frequencies`, `spectral_samples`, `log_temperature_scale`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from linattn_jax import _checks, core, flexformer_positive
from linattn_jax.performer import orthogonal_features
from linattn_jax.registry import Mechanism, register

_f32 = jnp.float32
_INIT_METHODS = ("gaussian", "orthogonal")
_PAIR_INITS = ("jitter", "tied", "independent")
FEATURES = ("trig", "positive")  # the feature kinds (module docstring, "Options")
#: each variant's default feature kind (module docstring, "Defaults")
DEFAULT_FEATURES = {"s": "trig", "n": "positive"}
PAIR_JITTER = 0.1  # default flexformer_n pair jitter (see init_n)
QK_RADIUS = 1.0  # default |q^| = |k^| before the map (module docstring, "Stability")
DEN_FLOOR = 0.05  # default relative denominator floor (module docstring, "Stability")
FREQ_KEYS = {"s": ("omega_tilde",), "n": ("omega1_tilde", "omega2_tilde")}  # stored omega / c
_TEMP_KEY = {"s": "log_scale", "n": "tau"}
_DIRECT_KEYS = {"s": ("omega",), "n": ("omega1", "omega2")}  # the layout that stored omega


def freq_scale_of(variant, num_heads, head_dim, freq_scale=None):
    """The constant ``c`` of ``omega = c * omega_tilde``: `freq_scale`, or when None the
    variant's default (module docstring, "Parameterisation"): ``sqrt(num_heads * head_dim)``
    for flexformer_n (`variant` ``"n"``), ``sqrt(head_dim)`` for flexformer_s (``"s"``)."""
    if freq_scale is not None:
        return float(freq_scale)
    return math.sqrt(num_heads * head_dim if variant == "n" else head_dim)


def _draw_frequencies(rng, num_heads, num_features, head_dim, init_method):
    if init_method == "gaussian":
        return jax.random.normal(rng, (num_heads, num_features, head_dim), _f32)
    return orthogonal_features(rng, num_heads, num_features, head_dim)


def _check_freq_scale(name, freq_scale):
    if freq_scale is not None:
        _checks.check_float(name, "freq_scale", freq_scale, lambda x: x > 0, "a float > 0 or None")


def _check_init(name, num_heads, head_dim, num_features, init_method, init_scale, freq_scale):
    _checks.check_positive(name, num_heads=num_heads, head_dim=head_dim, num_features=num_features)
    _checks.check_choice(name, "init_method", init_method, _INIT_METHODS)
    _checks.check_float(name, "init_scale", init_scale, lambda x: x > 0, "a float > 0")
    _check_freq_scale(name, freq_scale)


def _with_bandwidth(params, num_heads, head_dim, learn_bandwidth):
    _checks.check_bool("flexformer", "learn_bandwidth", learn_bandwidth)
    if learn_bandwidth:
        params["log_bandwidth"] = jnp.zeros((num_heads, head_dim), _f32)
    return params


def init_s(
    rng,
    *,
    num_heads: int,
    head_dim: int,
    num_features: int = 128,
    init_method: str = "gaussian",
    init_scale: float = 1.0,
    learn_bandwidth: bool = False,
    freq_scale: float | None = None,
):
    """``{"omega_tilde": [H, M, d], "log_scale": [H]}``: the frequencies ``omega = c *
    omega_tilde`` i.i.d. ``N(0, init_scale^2)`` (or orthogonal blocks times `init_scale`, see
    module doc), stored divided by ``c = freq_scale_of("s", num_heads, head_dim, freq_scale)``
    ("Parameterisation"); ``log_scale = 0`` (the temperature at init is 1; with the default
    ``init_scale=1`` the seed's map). `learn_bandwidth` adds ``"log_bandwidth" [H, d]``
    (init 0; module docstring, "Options")."""
    _check_init(
        "flexformer_s", num_heads, head_dim, num_features, init_method, init_scale, freq_scale
    )
    omega = _draw_frequencies(rng, num_heads, num_features, head_dim, init_method)
    c = freq_scale_of("s", num_heads, head_dim, freq_scale)
    params = {
        "omega_tilde": (init_scale / c) * omega,
        "log_scale": jnp.zeros((num_heads,), _f32),
    }
    return _with_bandwidth(params, num_heads, head_dim, learn_bandwidth)


def init_n(
    rng,
    *,
    num_heads: int,
    head_dim: int,
    num_features: int = 128,
    init_method: str = "gaussian",
    pair_init: str = "jitter",
    pair_jitter: float = PAIR_JITTER,
    init_scale: float = 1.0,
    learn_bandwidth: bool = False,
    freq_scale: float | None = None,
):
    """``{"omega1_tilde", "omega2_tilde": [H, M, d], "tau": [H]}``; ``tau = log(2 sqrt d)``.

    The frequency pair ``omega_p = c * omega_p_tilde`` is stored divided by ``c =
    freq_scale_of("n", num_heads, head_dim, freq_scale)`` (as `init_s`). `init_scale`
    multiplies both frequency matrices (drawn as below), `learn_bandwidth` adds
    ``"log_bandwidth" [H, d]`` (as `init_s`).

    ``omega1`` = the draw `init_s` makes from the same `rng`. ``omega2`` by `pair_init`:

    - ``"jitter"`` (default): ``omega1 + pair_jitter * N(0, I)``. Why: the paired
      features are symmetric under swapping ``omega1 <-> omega2``, so at ``omega1 ==
      omega2`` the two gradients are identical and gradient training keeps the pair
      tied forever (the kernel stays stationary; only ``tau`` moves it). The jitter
      breaks the tie; the cross terms then estimate ``exp(q^.k^ - pair_jitter^2
      |k^|^2 / 2)`` (resp. ``|q^|^2``) instead of ``exp(q^.k^)``, a bias of
      ``pair_jitter^2 |x^|^2 / 4`` in the log kernel (0.25% at the default 0.1 and
      ``|x^| = 1``).
    - ``"tied"``: ``omega2 = omega1``: at init the mechanism equals ``flexformer_s``
      exactly (and stays stationary under gradient training).
    - ``"independent"``: a second independent draw; the cross terms then estimate 1,
      not the softmax kernel (the init is far from the RFF estimator).
    """
    _check_init(
        "flexformer_n", num_heads, head_dim, num_features, init_method, init_scale, freq_scale
    )
    _checks.check_choice("flexformer_n", "pair_init", pair_init, _PAIR_INITS)
    _checks.check_float(
        "flexformer_n", "pair_jitter", pair_jitter, lambda x: x >= 0, "a float >= 0"
    )
    omega = _draw_frequencies(rng, num_heads, num_features, head_dim, init_method)
    key2 = jax.random.fold_in(rng, 1)
    if pair_init == "tied":
        omega2 = omega
    elif pair_init == "independent":
        omega2 = _draw_frequencies(key2, num_heads, num_features, head_dim, init_method)
    else:
        omega2 = omega + pair_jitter * jax.random.normal(key2, omega.shape, _f32)
    c = freq_scale_of("n", num_heads, head_dim, freq_scale)
    params = {
        "omega1_tilde": (init_scale / c) * omega,
        "omega2_tilde": (init_scale / c) * omega2,
        "tau": jnp.full((num_heads,), math.log(2.0 * math.sqrt(head_dim)), _f32),
    }
    return _with_bandwidth(params, num_heads, head_dim, learn_bandwidth)


def _project(xh, omega):
    """``Omega x^`` heads first: `xh` ``[B, H, T, d]`` -> ``[B, H, T, M]``."""
    # Full float32 precision: cos/sin of Omega x^ are sensitive to rounding of the
    # argument, and accelerators default to reduced-precision matmuls. The input is the
    # left operand and the (small) frequencies are broadcast over B, so the product comes
    # out in this layout (jnp.einsum would put omega first: a [H, M, B, T] product and an
    # M-wide transpose).
    omega = jnp.broadcast_to(omega.astype(_f32), (xh.shape[0], *omega.shape))
    dims = (((3,), (3,)), ((0, 1), (0, 1)))
    return lax.dot_general(xh, omega, dims, precision=lax.Precision.HIGHEST)


def _stabilised_norm_factor(s, *, is_query, mask):
    """``exp(s - c)`` with the detached c; `s` is ``[B, T, H, 1]``."""
    if is_query:
        return jnp.exp(s - lax.stop_gradient(s))  # == 1: cancels from the ratio anyway
    b, t = s.shape[:2]
    valid = core.key_mask(mask, t, b)[:, :, None, None]
    c = lax.stop_gradient(core.masked_max(s, valid, axis=1))  # [B, 1, H, 1]
    # Masked keys get factor 0 before the exp: a large masked key must not overflow
    # (inf * 0 = NaN when the core zeroes it).
    return jnp.exp(jnp.where(valid, s - c, -jnp.inf))


def _trig(xh, *omegas):
    """``(p^2 M)^(-1/2) [sum_p cos | sum_p sin](Omega_p x^)`` heads first, ``[B, H, T, 2M]``
    for the p frequency matrices `omegas` (``[H, M, d]`` each; flexformer_s: one,
    flexformer_n: two): one product with the stacked frequencies ``[H, p M, d]``, then one
    elementwise pass (`core.cos_sin`) that writes both halves."""
    p, m = len(omegas), omegas[0].shape[1]
    wx = _project(xh, omegas[0] if p == 1 else jnp.concatenate(omegas, axis=1))
    # the scale after the stack: a stack consumed by a product XLA fuses into each consumer
    # (recomputing the features once per consumer), one consumed by this multiply it does not
    feats = core.cos_sin(wx, p) * (p * p * m) ** -0.5  # [B, H, T, 2, M]
    return feats.reshape(*feats.shape[:-2], -1)


def _log_norm_s(xh):
    """``|x^|^2 / 2 = |x|^2 / (2 sqrt d)`` as ``[B, T, H, 1]``."""
    return 0.5 * core.rowdot(xh, xh)[..., None]


def _log_norm_n(x, tau):
    """``|x|^2 / exp(tau)`` as ``[B, T, H, 1]``; `tau` is ``[H]``."""
    x = x.astype(_f32)
    inv_scale = jnp.exp(-tau.astype(_f32))[None, None, :, None]
    return core.rowdot(x, x)[..., None] * inv_scale


def _normalize(x, radius):
    """``x`` rescaled so that ``|x^| = radius`` (float32; ``None``: unchanged)."""
    x = x.astype(_f32)
    if radius is None:
        return x
    # `core.rowdot` / `core.scale_rows`: XLA's CPU multiply-reduce is slow at batch 1
    norm = jnp.sqrt(core.rowdot(x, x) + 1e-12)
    return core.scale_rows(x, radius * x.shape[-1] ** 0.25 / norm)


def _scaled_input(x, params, radius):
    """`_normalize`, then the per-dimension bandwidth ``b`` when learned: the map of ``b * x``."""
    x = _normalize(x, radius)
    if "log_bandwidth" in params:
        x = x * jnp.exp(params["log_bandwidth"].astype(_f32))[None, None]
    return x


def log_temperature_scale(params, head_dim, *, qk_radius=QK_RADIUS):
    """The per-head log of the scale ``a`` the map applies to ``x^`` (``[H]`` float32).

    ``flexformer_s``: ``params["log_scale"]`` (any `qk_radius`). ``flexformer_n``: ``(log(2
    sqrt d) - tau) / 2`` when `qk_radius` is set (tau tied to the scale: ``a^2 = 2 sqrt d /
    exp(tau)``, 0 at init), 0 with ``qk_radius=None`` (the seed's raw map, where tau acts
    through the norm term only). The kernel estimated at init is ``exp(a^2 q^ . k^)``.
    """
    if _variant(params) == "s":
        return params["log_scale"].astype(_f32)
    tau = params["tau"].astype(_f32)
    if qk_radius is None:
        return jnp.zeros_like(tau)
    return 0.5 * (math.log(2.0 * math.sqrt(head_dim)) - tau)


def frequencies(params, *, freq_scale=None):
    """The frequencies ``omega = c * omega_tilde`` as a tuple of ``[H, M, d]`` float32: one for
    ``flexformer_s``, the pair for ``flexformer_n`` (read off the param names; ``c`` as
    `freq_scale_of` of the variant and the params' ``[H, M, d]``)."""
    variant = _variant(params)
    stored = [params[key].astype(_f32) for key in FREQ_KEYS[variant]]
    c = freq_scale_of(variant, stored[0].shape[0], stored[0].shape[-1], freq_scale)
    return tuple(c * w for w in stored)


def _parts_heads_first(variant, x, params, radius=None, freq_scale=None):
    """``(s, phi)``: log norm factor ``[B, T, H, 1]`` and trig features heads first
    ``[B, H, T, 2M]``."""
    x = _scaled_input(x, params, radius)
    xh = core.scale_inputs(x)
    d = x.shape[-1]
    # the features of a x^ (a the per-head temperature scale): a and the frequency scale c
    # are folded into the frequencies ([H, M, d]), not into the [B, T, H, d] input
    a = jnp.exp(log_temperature_scale(params, d, qk_radius=radius))[:, None, None]
    ac = a * freq_scale_of(variant, params[FREQ_KEYS[variant][0]].shape[0], d, freq_scale)
    omegas = [ac * params[key].astype(_f32) for key in FREQ_KEYS[variant]]
    # the features are computed heads first (the d-wide input is transposed, not the
    # 2M-wide features); callers hand them back in the core's layout (`core.heads_last`)
    xt = jnp.swapaxes(xh, 1, 2)
    if variant == "s":
        s = _log_norm_s(xh) * jnp.square(a[:, 0])[None, None]  # |a x^|^2 / 2
        return s, _trig(xt, *omegas)
    # with qk_radius, |x|^2 / exp(tau) == |a x^|^2 / 2: the norm term of the scaled input
    return _log_norm_n(x, params["tau"]), _trig(xt, *omegas)


def _parts(variant, x, params, radius=None, freq_scale=None):
    """``(s, phi)``: log norm factor ``[B, T, H, 1]`` and trig features ``[B, T, H, 2M]``."""
    s, phi = _parts_heads_first(variant, x, params, radius, freq_scale)
    return s, core.heads_last(phi)


def _positive_parts(variant, x, params, radius=None, freq_scale=None):
    """``(s, phi)`` as `_parts`, for ``features="positive"``: the positive features
    ``[B, T, H, M]`` (`flexformer_positive.features`) of ``y = a x^`` (the normalised,
    bandwidth- and temperature-scaled input) and the learned frequencies, ``s`` their
    detached per-token max; for flexformer_n's raw map (``radius=None``) ``s`` adds the
    paper's norm term in place of FAVOR+'s, ``|x|^2 / exp(tau) - |x^|^2 / 2`` (0 at the init
    tau)."""
    x = _scaled_input(x, params, radius)
    a = jnp.exp(log_temperature_scale(params, x.shape[-1], qk_radius=radius))
    omegas = frequencies(params, freq_scale=freq_scale)
    phi, n = flexformer_positive.features(x * a[None, None, :, None], omegas)
    s = n[..., None]
    if variant == "n" and radius is None:
        s = s + _log_norm_n(x, params["tau"]) - _log_norm_s(core.scale_inputs(x))
    return s, phi


def _feature_parts(name, features):
    """`_parts` or `_positive_parts` by `features` (checked)."""
    _checks.check_choice(name, "features", features, FEATURES)
    return _positive_parts if features == "positive" else _parts


def _stabilised_features(variant, x, params, is_query, mask, radius, freq_scale, features):
    """The body of `feature_map_s` and `feature_map_n`."""
    parts = _feature_parts("flexformer_" + variant, features)
    s, phi = parts(variant, x, params, radius, freq_scale)
    return _stabilised_norm_factor(s, is_query=is_query, mask=mask) * phi


def feature_map_s(
    x, params, *, is_query: bool, mask=None, qk_radius=QK_RADIUS, freq_scale=None, features="trig"
):
    """Stabilised ``flexformer_s`` features ``[B, T, H, d] -> [B, T, H, 2M]`` float32.

    ``phi~(x) exp(-c)``: ``phi~`` as in the module docstring, c the detached
    stabiliser (per token for queries, the max over unmasked keys for keys;
    `mask` ``[B, T]`` is used for the key stabiliser only and zeroes masked keys).
    This is the non-causal stabilisation; causal attention uses the running max
    (module docstring), which gives the same normalised weights up to rounding.
    ``features="positive"``: the positive features (`flexformer_positive`, ``[B, T, H, M]``).
    """
    return _stabilised_features("s", x, params, is_query, mask, qk_radius, freq_scale, features)


def feature_map_n(
    x,
    params,
    *,
    is_query: bool,
    mask=None,
    qk_radius=QK_RADIUS,
    freq_scale=None,
    features=DEFAULT_FEATURES["n"],
):
    """Stabilised ``flexformer_n`` features ``[B, T, H, d] -> [B, T, H, 2M]`` float32.

    Same conventions as `feature_map_s`, with ``phi~(x) = exp(|x|^2 / exp(tau)) phi_n(x)``
    (``features="positive"``: the positive pair features, ``[B, T, H, M]``).
    """
    return _stabilised_features("n", x, params, is_query, mask, qk_radius, freq_scale, features)


def _variant(params):
    keys = set(params) - {"log_bandwidth"}
    for variant, freq_keys in FREQ_KEYS.items():
        if keys == {*freq_keys, _TEMP_KEY[variant]}:
            return variant
    for variant, direct in _DIRECT_KEYS.items():
        if keys == {*direct, _TEMP_KEY[variant]}:
            raise ValueError(
                f"flexformer: params {sorted(params)} store the frequencies directly (an older "
                f"layout); they are now stored as {list(FREQ_KEYS[variant])} = omega / c with "
                "c = freq_scale_of(variant, H, d) (module docstring, 'Parameterisation'): "
                "convert with "
                "`from_direct_params`"
            )
    raise ValueError(
        "flexformer: params must be flexformer_s params {'omega_tilde', 'log_scale'} or "
        "flexformer_n params {'omega1_tilde', 'omega2_tilde', 'tau'} (either with an optional "
        f"'log_bandwidth'), got keys {sorted(params)}"
    )


def from_direct_params(params, *, freq_scale=None):
    """Params of the layout that stored the frequencies themselves (``"omega"``, resp.
    ``"omega1"``, ``"omega2"``) in this module's layout (``omega / c`` under the
    ``"*_tilde"`` names; every other param unchanged): the same kernel."""
    params = dict(params)
    for variant, direct in _DIRECT_KEYS.items():
        if all(key in params for key in direct):
            h, _, d = params[direct[0]].shape
            c = freq_scale_of(variant, h, d, freq_scale)
            for old, new in zip(direct, FREQ_KEYS[variant], strict=True):
                params[new] = params.pop(old) / c
    _variant(params)
    return params


def kernel(q, k, params, *, qk_radius=QK_RADIUS, freq_scale=None, features=None):
    """The unstabilised kernel estimate ``phi~(q_i) . phi~(k_j)`` as ``[B, H, Tq, Tk]`` float32.

    For inspection, plots and tests (the variant is read off the param names).
    ``q: [B, Tq, H, d]``, ``k: [B, Tk, H, d]``. At init its expectation over the
    frequencies is ``exp(q . k / sqrt d)``. Not stabilised: it overflows for
    large norms, exactly as the kernel itself does. `features`: the variant's default
    (`DEFAULT_FEATURES`) when None; ``"positive"``: the positive estimate ``phi+(q_i) .
    phi+(k_j)`` (`flexformer_positive`; the raw map of flexformer_n with its norm term),
    every entry positive.
    """
    variant = _variant(params)
    features = DEFAULT_FEATURES[variant] if features is None else features
    parts = _feature_parts("flexformer_" + variant, features)
    sq, pq = parts(variant, q, params, qk_radius, freq_scale)
    sk, pk = parts(variant, k, params, qk_radius, freq_scale)
    dots = jnp.einsum("bihm,bjhm->bhij", pq, pk, precision=lax.Precision.HIGHEST)
    norms = (
        sq[..., 0].transpose(0, 2, 1)[..., :, None] + sk[..., 0].transpose(0, 2, 1)[..., None, :]
    )
    return jnp.exp(norms) * dots


def trig_kernel(q, k, params, *, freq_scale=None):
    """The trigonometric part ``phi(q_i) . phi(k_j)`` (``phi_n`` for ``flexformer_n``) as
    ``[B, H, Tq, Tk]`` float32, without the norm factors: the Bochner (stationary) resp.
    Yaglom (non-stationary) kernel the frequencies define, on the raw inputs
    (``qk_radius=None``: ``flexformer_s``'s temperature applies, ``tau`` does not)."""
    variant = _variant(params)
    _, pq = _parts(variant, q, params, None, freq_scale)
    _, pk = _parts(variant, k, params, None, freq_scale)
    return jnp.einsum("bihm,bjhm->bhij", pq, pk, precision=lax.Precision.HIGHEST)


def shift_invariance_gap(params, x, y, shifts, *, freq_scale=None):
    """How far the trigonometric kernel is from stationary: ``sum Var_s / sum E_s[k^2]``.

    ``k_s = trig_kernel(x + s, y + s)`` for every shift ``s`` in `shifts` ``[S, d]`` and
    every pair of rows of `x`, `y` ``[B, T, H, d]``; the variance and mean square are
    over the shifts, summed over pairs and heads. 0 for a stationary kernel (every
    ``flexformer_s``, and ``flexformer_n`` with ``omega1 == omega2``), up to rounding;
    at most 1.
    """
    shifts = jnp.asarray(shifts, _f32)[:, None, None, None, :]  # [S, 1, 1, 1, d]
    ks = jnp.stack(
        [trig_kernel(x + s, y + s, params, freq_scale=freq_scale) for s in shifts]
    )  # [S, B, H, Tq, Tk]
    return jnp.sum(jnp.var(ks, axis=0)) / jnp.sum(jnp.mean(ks * ks, axis=0))


def spectral_samples(params, *, freq_scale=None):
    """The learned frequencies per head: ``omega [H, M, d]`` for ``flexformer_s``,
    ``concat(omega1, omega2) [H, 2M, d]`` for ``flexformer_n`` (`frequencies`, stacked)."""
    return jnp.concatenate(frequencies(params, freq_scale=freq_scale), axis=1)


def _check_freqs(name, params, keys, h, d, extra=None):
    _checks.require_params(name, params, keys[0])
    w = params[keys[0]]
    if w.ndim != 3 or w.shape[0] != h or w.shape[2] != d:
        raise ValueError(
            f"{name}: params[{keys[0]!r}] has shape {tuple(w.shape)}, expected [H={h}, M, d={d}]"
        )
    expected = {key: w.shape for key in keys}
    expected.update(extra or {})
    if "log_bandwidth" in params:
        expected["log_bandwidth"] = (h, d)
    _checks.check_params(name, params, expected)


def _feature_map(variant):
    """The `core.FeatureMap` of one variant: queries get the trigonometric features (their
    norm factor cancels in the ratio), keys the same with the log norm factor as their
    log scale (stabilised by the core)."""

    # the mass channel is appended heads first, so that the core's swap back to heads first
    # cancels `heads_last` and its split drops the channel again without a transpose
    name = "flexformer_" + variant

    default = DEFAULT_FEATURES[variant]

    def query(
        q, params, *, qk_radius=QK_RADIUS, den_floor=DEN_FLOOR, freq_scale=None, features=default
    ):
        _feature_parts(name, features)
        if features == "positive":  # heads last already; its per-token max cancels; no floor
            return _positive_parts(variant, q, params, qk_radius, freq_scale)[1]
        phi = _parts_heads_first(variant, q, params, qk_radius, freq_scale)[1]
        return core.heads_last(core.mass_channel(phi, is_query=True) if den_floor else phi)

    def key(
        k, params, *, qk_radius=QK_RADIUS, den_floor=DEN_FLOOR, freq_scale=None, features=default
    ):
        _feature_parts(name, features)
        if features == "positive":  # the per-token max as the key's log scale; no floor
            s, phi = _positive_parts(variant, k, params, qk_radius, freq_scale)
            return core.KeyFeatures(phi, s[..., 0])
        s, phi = _parts_heads_first(variant, k, params, qk_radius, freq_scale)
        phi = core.mass_channel(phi, is_query=False) if den_floor else phi
        return core.KeyFeatures(core.heads_last(phi), s[..., 0])

    def floor(*, den_floor=DEN_FLOOR, features=default):
        # positive features have positive denominators: the floor (made for cancelling
        # trigonometric sums) would only shrink the rows of sharp kernels
        return 0.0 if features == "positive" else den_floor

    return core.FeatureMap(query_fn=query, key_fn=key, floor_fn=floor, token_wise=True)


FEATURE_MAPS = {"flexformer_s": _feature_map("s"), "flexformer_n": _feature_map("n")}


def _check_map_config(name, radius, den_floor):
    if radius is not None:
        _checks.check_float(name, "qk_radius", radius, lambda x: x > 0, "a float > 0 or None")
    _checks.check_float(name, "den_floor", den_floor, lambda x: 0 <= x < 1, "a float in [0, 1)")


def _attend(name, quadratic, q, k, v, params, mask, causal, chunk_size, config):
    """The body of `attention_s`, `reference_s`, `attention_n` and `reference_n` (`config`:
    learn_frequencies, qk_radius, den_floor, freq_scale, features)."""
    _checks.check_inputs(name, q, k, v, mask, causal=causal)
    _checks.check_positive(name, chunk_size=chunk_size)
    h, d = q.shape[2], q.shape[3]
    variant = name[-1]
    freq_keys = FREQ_KEYS[variant]
    if isinstance(params, dict) and set(params) & set(_DIRECT_KEYS[variant]):
        _variant(params)  # the older layout: a clear error
    _check_freqs(name, params, freq_keys, h, d, {_TEMP_KEY[variant]: (h,)})
    learn_frequencies = config.pop("learn_frequencies")
    _check_map_config(name, config["qk_radius"], config["den_floor"])
    _check_freq_scale(name, config["freq_scale"])
    _feature_parts(name, config["features"])
    params = dict(params)
    if not learn_frequencies:
        for key in freq_keys:
            params[key] = lax.stop_gradient(params[key])
    return core.attend_features(
        FEATURE_MAPS[name], q, k, v, params, mask=mask, causal=causal, chunk_size=chunk_size,
        quadratic=quadratic, **config,
    )  # fmt: skip


def attention_s(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, chunk_size=64,
    learn_frequencies=True, qk_radius=QK_RADIUS, den_floor=DEN_FLOOR, freq_scale=None,
    features="trig",
):  # fmt: skip
    """``flexformer_s`` attention ``[B, Tq, H, Dv]``; `rng` and `deterministic` are unused.

    ``out_i = phi~(q_i)^T S / phi~(q_i)^T z`` with ``S = sum_j phi~(k_j) v_j^T``,
    ``z = sum_j phi~(k_j)`` over unmasked keys (``j <= i`` when causal, chunked
    with `chunk_size`). ``learn_frequencies=False`` stops gradients to ``omega_tilde``.
    """
    del rng, deterministic
    config = dict(
        learn_frequencies=learn_frequencies, qk_radius=qk_radius, den_floor=den_floor,
        freq_scale=freq_scale, features=features,
    )  # fmt: skip
    return _attend("flexformer_s", False, q, k, v, params, mask, causal, chunk_size, config)


def reference_s(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, chunk_size=64,
    learn_frequencies=True, qk_radius=QK_RADIUS, den_floor=DEN_FLOOR, freq_scale=None,
    features="trig",
):  # fmt: skip
    """The naive quadratic form of `attention_s` (same features)."""
    del rng, deterministic
    config = dict(
        learn_frequencies=learn_frequencies, qk_radius=qk_radius, den_floor=den_floor,
        freq_scale=freq_scale, features=features,
    )  # fmt: skip
    return _attend("flexformer_s", True, q, k, v, params, mask, causal, chunk_size, config)


def attention_n(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, chunk_size=64,
    learn_frequencies=True, qk_radius=QK_RADIUS, den_floor=DEN_FLOOR, freq_scale=None,
    features=DEFAULT_FEATURES["n"],
):  # fmt: skip
    """``flexformer_n`` attention ``[B, Tq, H, Dv]``; as `attention_s` with the paired
    features. ``learn_frequencies=False`` stops gradients to ``omega1_tilde``,
    ``omega2_tilde`` (``tau`` stays learnable)."""
    del rng, deterministic
    config = dict(
        learn_frequencies=learn_frequencies, qk_radius=qk_radius, den_floor=den_floor,
        freq_scale=freq_scale, features=features,
    )  # fmt: skip
    return _attend("flexformer_n", False, q, k, v, params, mask, causal, chunk_size, config)


def reference_n(
    q, k, v, params, rng=None, *, mask=None, causal=False, deterministic=False, chunk_size=64,
    learn_frequencies=True, qk_radius=QK_RADIUS, den_floor=DEN_FLOOR, freq_scale=None,
    features=DEFAULT_FEATURES["n"],
):  # fmt: skip
    """The naive quadratic form of `attention_n` (same features)."""
    del rng, deterministic
    config = dict(
        learn_frequencies=learn_frequencies, qk_radius=qk_radius, den_floor=den_floor,
        freq_scale=freq_scale, features=features,
    )  # fmt: skip
    return _attend("flexformer_n", True, q, k, v, params, mask, causal, chunk_size, config)


def _params_config(params, freq_key):
    return {
        "num_features": params[freq_key].shape[1],
        "learn_bandwidth": "log_bandwidth" in params,
    }


def _fixed_s(*, learn_frequencies=True):
    return frozenset() if learn_frequencies else frozenset(FREQ_KEYS["s"])


def _fixed_n(*, learn_frequencies=True):
    return frozenset() if learn_frequencies else frozenset(FREQ_KEYS["n"])


MECHANISM_S = register(
    Mechanism(
        name="flexformer_s",
        init_fn=init_s,
        attention_fn=attention_s,
        reference_fn=reference_s,
        supports_causal=True,
        stochastic=False,
        fixed_fn=_fixed_s,
        feature_map_spec=FEATURE_MAPS["flexformer_s"],
        params_config_fn=lambda params: _params_config(params, FREQ_KEYS["s"][0]),
        description="learnable spectral RFF, stationary (Bochner); Flexformer_s, O(T)",
    )
)

MECHANISM_N = register(
    Mechanism(
        name="flexformer_n",
        init_fn=init_n,
        attention_fn=attention_n,
        reference_fn=reference_n,
        supports_causal=True,
        stochastic=False,
        fixed_fn=_fixed_n,
        feature_map_spec=FEATURE_MAPS["flexformer_n"],
        params_config_fn=lambda params: _params_config(params, FREQ_KEYS["n"][0]),
        description="learnable spectral RFF pairs + scale, non-stationary (Yaglom), positive "
        "features by default; Flexformer_n, O(T)",
    )
)
