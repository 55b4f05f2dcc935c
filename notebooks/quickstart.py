# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # linattn_jax quickstart
#
# Every attention mechanism in the registry, on toy data:
#
# 1. run each mechanism through the one functional API and compare it with exact softmax;
# 2. look at the attention maps each one effectively computes, side by side with softmax;
# 3. the fidelity curve: error against softmax as the feature / landmark / sample budget grows;
# 4. a learned Flexformer spectrum: fit `flexformer_n` to a target attention and compare its
#    frequencies before and after.
#
# This notebook is the source `notebooks/quickstart.py` (jupytext, percent format) paired with
# `quickstart.ipynb`. With `LINATTN_NOTEBOOK_SMALL=1` it runs on small sizes in seconds (the
# tests execute it that way).

# %%
import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import linattn_jax as la
from linattn_jax import flexformer
from train import bench

SMALL = os.environ.get("LINATTN_NOTEBOOK_SMALL", "0") == "1"
T = 24 if SMALL else 64  # toy sequence length
H, D = 1, 16  # heads, head dim
print("mechanisms:", la.names())
print("small run" if SMALL else "full run", "| backend:", jax.default_backend())

# %% [markdown]
# ## 1. Every mechanism through one API
#
# Layout `[B, T, H, D]`. The toy sequence has three clusters of consecutive tokens: queries and
# keys of a cluster share a centre, so exact softmax attention is block-diagonal.
# `init` makes a mechanism's params (random features, learnable spectra, ...; `{}` if none);
# sampling mechanisms also take an rng.

# %%
clusters = 3
key_c, key_q, key_k, key_v = jax.random.split(jax.random.key(0), 4)
centres = 1.2 * jax.random.normal(key_c, (clusters, D))
cluster_of = (jnp.arange(T) * clusters) // T  # contiguous blocks
q = centres[cluster_of][None, :, None, :] + 0.4 * jax.random.normal(key_q, (1, T, H, D))
k = centres[cluster_of][None, :, None, :] + 0.4 * jax.random.normal(key_k, (1, T, H, D))
v = jax.random.normal(key_v, (1, T, H, D))

# One call per mechanism returns both the outputs (values v) and the attention map (values
# eye(T), see section 2): the values are concatenated along the value dimension.
eye = jnp.broadcast_to(jnp.eye(T)[None, :, None, :], (1, T, H, T))


def run(name, values, causal=False):
    mech = la.get(name)
    params = mech.init(jax.random.key(1), num_heads=H, head_dim=D)
    return mech.attention(q, k, values, params, jax.random.key(2), causal=causal)


outputs, maps = {}, {}
for name in la.names():
    both = run(name, jnp.concatenate([v, eye], axis=-1))
    outputs[name], maps[name] = both[..., :D], np.asarray(both[0, :, 0, D:])
for name in la.names():
    mech = la.get(name)
    err = bench.relative_error(outputs[name], outputs["softmax"])
    print(
        f"{name:14s} out {tuple(outputs[name].shape)}  relative error {err:.3f}  "
        f"causal={mech.supports_causal}  stochastic={mech.stochastic}"
    )

# %% [markdown]
# ## 2. Attention maps
#
# Attending with the identity as values, `v = eye(T)`, returns the `T x T` matrix of weights
# any mechanism applies (for a feature-map mechanism this equals
# `linattn_jax.core.normalized_weights` of its features; for the Nystrom family and LARA it is
# the effective low-rank matrix). Colours share softmax's scale; weights that the
# approximations make negative show as white (clipped).

# %%
vmax = maps["softmax"].max()
cols = 4
rows = -(-len(maps) // cols)
fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows))
cm = plt.get_cmap("viridis").copy()
cm.set_under("white")
for ax, (name, w) in zip(axes.flat, maps.items()):
    ax.imshow(w, vmin=1e-9, vmax=vmax, cmap=cm)
    err = np.abs(w - maps["softmax"]).sum(1).mean()
    ax.set_title(f"{name}\nmean row L1 to softmax {err:.2f}", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
for ax in list(axes.flat)[len(maps) :]:
    ax.axis("off")
fig.suptitle("attention weights (query rows x key columns), non-causal")
fig.tight_layout()
plt.show()

# %% [markdown]
# The causal mechanisms, with `causal=True`: each row only sees the keys up to its position.

# %%
causal_names = la.causal_names()
fig, axes = plt.subplots(1, len(causal_names), figsize=(2.4 * len(causal_names), 2.8))
for ax, name in zip(np.atleast_1d(axes), causal_names):
    ax.imshow(np.asarray(run(name, eye, causal=True)[0, :, 0]), vmin=1e-9, vmax=vmax, cmap=cm)
    ax.set_title(name, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
fig.suptitle("causal attention weights")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Fidelity as the budget grows
#
# `train.bench.fidelity_sweep` (the same code as `python -m train.bench fidelity`) measures
# `|out - softmax|_F / |softmax|_F` for every budget key a mechanism has (`num_features`,
# `num_landmarks`, `num_samples`), on Gaussian inputs (diffuse attention) and clustered inputs
# (sharp attention), averaged over seeds. Mechanisms without a budget are dotted lines.

# %%
if SMALL:
    fid = bench.fidelity_sweep(
        ["performer", "flexformer_s", "nystromformer"],
        budgets=(4, 16),
        seeds=2,
        seq_len=32,
        heads=1,
        head_dim=16,
    )
else:
    fid = bench.fidelity_sweep(budgets=(8, 32, 128), seeds=2, seq_len=128, heads=1, head_dim=16)
print(bench.fidelity_table(fid))
bench.plot_fidelity(fid)
plt.show()

# %% [markdown]
# ## 4. A learned Flexformer spectrum
#
# `flexformer_n` with the paper's trigonometric map (`features="trig"`; its default, the positive
# map, estimates another kernel family, whose exact answer for this target differs)
# starts close to the random-Fourier-feature estimator of the softmax kernel
# `exp(q.k / sqrt d)`: frequency pairs `omega1 ~ N(0, I)`, `omega2 = omega1 + 0.1 N(0, I)` (the
# jitter lets the pair separate) and the scale `tau = log(2 sqrt d)`. Here we
# fit it to a softer kernel, `exp(beta q.k / sqrt d)` with `beta = 0.5` (softmax attention at
# temperature 2), whose exact spectral answer is known: frequencies `N(0, beta I)` and
# `tau = log(2 sqrt(d) / beta)`. The loss compares the kernel estimate
# `flexformer.kernel(q, k, params)` with the target kernel, row by row relative to the
# target's row sums, on fresh Gaussian queries and keys each step (Adam, clipped gradients).
# Fitting the kernel rather than the normalised attention avoids dividing by the estimate's
# denominator, which trigonometric features can bring close to zero (see the fidelity table).
# The kernel is that of the raw inputs (`qk_radius=None`; attention's default normalises q and
# k first, see `linattn_jax.flexformer`). The last panel shows the pair separating:
# `|omega2 - omega1|` per frequency, and the kernel's shift-invariance gap (0 = stationary).

# %%
beta = 0.5
fit_t, num_features = (24, 32) if SMALL else (64, 64)
steps = 10 if SMALL else 150
mech = la.get("flexformer_n").bind(num_features=num_features, features="trig")
params0 = mech.init(jax.random.key(0), num_heads=1, head_dim=D)


def fit_loss(params, key):
    kq, kk = jax.random.split(key)
    qf = jax.random.normal(kq, (4, fit_t, 1, D))
    kf = jax.random.normal(kk, (4, fit_t, 1, D))
    target = jnp.exp(beta * jnp.einsum("bihd,bjhd->bhij", qf, kf) / np.sqrt(D))
    est = flexformer.kernel(qf, kf, params, qk_radius=None, features="trig")  # [B, H, Tq, Tk]
    return jnp.mean(jnp.sum((est - target) ** 2, -1) / jnp.sum(target, -1) ** 2)


# lr 0.02: the frequencies are stored as omega / c (c = sqrt(H d) = 4 here), so Adam moves omega
# by about c * lr per step
opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.02))


@jax.jit
def fit_step(params, opt_state, key):
    loss, grads = jax.value_and_grad(fit_loss)(params, key)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


params, opt_state, losses = params0, opt.init(params0), []
for step in range(steps):
    key = jax.random.fold_in(jax.random.key(3), step)
    params, opt_state, loss = fit_step(params, opt_state, key)
    losses.append(float(loss))

before = np.asarray(flexformer.spectral_samples(params0))  # [H, 2M, d]
after = np.asarray(flexformer.spectral_samples(params))
print(
    f"tau: {float(params0['tau'][0]):.3f} -> {float(params['tau'][0]):.3f} "
    f"(exact for the target: {np.log(2 * np.sqrt(D) / beta):.3f})"
)
print(
    f"frequency std: {before.std():.3f} -> {after.std():.3f} "
    f"(exact for the target: {np.sqrt(beta):.3f})"
)

gx, gy = jax.random.normal(jax.random.key(5), (2, 2, 8, 1, D))
shifts = 0.5 * jax.random.normal(jax.random.key(6), (8, D))
gaps = [float(flexformer.shift_invariance_gap(p, gx, gy, shifts)) for p in (params0, params)]
print(f"shift-invariance gap: {gaps[0]:.2e} -> {gaps[1]:.2e} (0 = stationary)")
fig, axes = plt.subplots(1, 4, figsize=(19, 3.8))
axes[0].plot(losses)
axes[0].set_yscale("log")
axes[0].set_xlabel("step")
axes[0].set_title("fit loss (relative squared error of the kernel)")
bins = np.linspace(-4, 4, 41)
axes[1].hist(before.ravel(), bins=bins, alpha=0.6, density=True, label="init")
axes[1].hist(after.ravel(), bins=bins, alpha=0.6, density=True, label="learned")
xs = np.linspace(-4, 4, 200)
exact_density = np.exp(-(xs**2) / (2 * beta)) / np.sqrt(2 * np.pi * beta)
axes[1].plot(xs, exact_density, "k--", label="N(0, beta): exact for the target")
axes[1].set_title("frequency entries omega (omega1 and omega2)")
axes[1].legend()
norms = np.linspace(0, 2.5 * np.sqrt(D), 41)
axes[2].hist(np.linalg.norm(before, axis=-1).ravel(), bins=norms, alpha=0.6, label="init")
axes[2].hist(np.linalg.norm(after, axis=-1).ravel(), bins=norms, alpha=0.6, label="learned")
axes[2].set_title("frequency norms |omega_m|")
axes[2].legend()
seps = [
    np.linalg.norm(np.subtract(*flexformer.frequencies(p)[::-1]), axis=-1).ravel()
    for p in (params0, params)
]
axes[3].hist(seps[0], bins=20, alpha=0.6, label="init (jitter)")
axes[3].hist(seps[1], bins=20, alpha=0.6, label="learned")
axes[3].set_title("pair separation |omega2_m - omega1_m|")
axes[3].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. The swap in a Flax model
#
# `la.linen.MultiHeadAttention` takes the arguments of flax's `nn.MultiHeadDotProductAttention`
# and names its params the same way (`query`/`key`/`value`/`out`), so swapping the attention of
# an existing Flax model is one line, and the model's trained weights carry over by path (the
# mechanism's own params are new). A small pre-LN block, written once, built with flax's
# attention and with ours; `attention="softmax"` reproduces flax's output exactly, and a
# mechanism that cannot honour a mask says so instead of ignoring it.


# %%
def make_block(attention_layer):
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, pad):
            mask = nn.make_attention_mask(pad, pad)
            x = x + attention_layer(name="attn")(nn.LayerNorm()(x), mask=mask)
            h = nn.gelu(nn.Dense(2 * x.shape[-1])(nn.LayerNorm()(x)))
            return x + nn.Dense(x.shape[-1])(h)

    return Block()


flax_block = make_block(functools.partial(nn.MultiHeadDotProductAttention, num_heads=2))
xb = jax.random.normal(jax.random.key(7), (2, T, 16))
pad = jnp.arange(T)[None, :] < jnp.array([[T], [T - 5]])  # the second sequence is padded
flax_vars = flax_block.init(jax.random.key(8), xb, pad)
want = flax_block.apply(flax_vars, xb, pad)

for name in ("softmax", "flexformer_n", "nystromformer"):
    config = (("num_features", 32),) if name == "flexformer_n" else ()
    # the one line that changes: the attention class (and its mechanism)
    layer = functools.partial(
        la.linen.MultiHeadAttention, num_heads=2, attention=name, attention_config=config
    )
    block = make_block(layer)
    fresh = block.init(jax.random.key(9), xb, pad)
    # flax's weights by path; the mechanism's own params (if any) stay as initialised
    params = jax.tree.map(lambda x: x, nn.meta.unbox(fresh["params"]))
    for key, value in flax_vars["params"].items():
        params[key] = {**params.get(key, {}), **value}
    got = block.apply({**fresh, "params": params}, xb, pad)
    err = float(jnp.max(jnp.abs(got - want)[0]))  # the unpadded sequence
    print(f"{name:14s} max |block out - flax block out| = {err:.2e}")

try:  # a causal mask given to a mechanism told nothing about causality
    la.linen.MultiHeadAttention(num_heads=2, attention="linear_elu").init(
        jax.random.key(0), xb, mask=nn.make_causal_mask(pad)
    )
except ValueError as e:
    print("refused:", str(e)[:120], "...")

# %% [markdown]
# ## Where next
#
# * `python -m train.bench scaling|fidelity|model|kernels` for the full benchmarks
#   (`docs/performance.md` has measured tables);
# * `linattn_jax.nn.MultiHeadAttention` / `linattn_jax.linen.MultiHeadAttention` to use any
#   mechanism inside a Flax model, by name (README: "Use in an existing Flax model").
