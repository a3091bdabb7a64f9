"""The optimizer updates in float64, written from their papers' formulas with torch.optim's
semantics: the independent reference every kernel test (reference, cpu, fused, hpu, ipex
kernel sets) compares a step against. Inputs may be any float dtype; results are float64
tensors (the inputs are never modified)."""
from __future__ import annotations

import math


def adam64(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step, adamw, bias_correction):
    """One Adam (L2 decay added to the gradient) or AdamW (decoupled decay) step; *step* is
    the 1-based count after it. Returns (p, m, v)."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    if adamw:
        p = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    c1 = 1 - beta1 ** step if bias_correction else 1.0
    c2 = 1 - beta2 ** step if bias_correction else 1.0
    return p - (lr / c1) * m / (v.sqrt() / math.sqrt(c2) + eps), m, v


def sgd64(p, g, buf, *, lr, momentum, dampening, weight_decay, nesterov, first_step):
    """One SGD step (torch.optim.SGD: the first momentum step stores the gradient undamped).
    Returns (p, momentum buffer)."""
    p, g = p.double(), g.double()
    d = g + weight_decay * p
    if momentum:
        buf = d if first_step else momentum * buf.double() + (1 - dampening) * d
        d = d + momentum * buf if nesterov else buf
    return p - lr * d, buf
