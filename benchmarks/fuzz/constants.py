"""Features around the Python values an op is handed: constants made anew at every step.

Terra checks such a value against the constant its graph holds, and a lane does it by
identity, by equality with the last value matched, or by the key of the value converted: each
feature changes, at some steps, what those checks must tell apart. A scalar whose type or
value changes, a shape or a list of multiples built at every step, a zero that is -0.0 at
some steps (equal to 0.0 in Python, not to ``atan2``), a numpy array written in place, a list
mixing ints and floats, and a list Python mutates between steps.
"""

from .snippets import feature


def _every(rng):
    """A step condition true at one step in ``k``, as an expression."""
    k = rng.choice([2, 3, 4])
    return f"step % {k} == {rng.randrange(k)}"


@feature("py_scalar")
def py_scalar(rng, tag, base):
    """A Python scalar made at every step: an int at some steps and a float of the same
    value at others, a float computed anew, or one whose value changes; handed to the op as
    it is (``tf.multiply``) or converted by the operator's wrapper."""
    when = _every(rng)
    value = rng.choice([f"(2 if {when} else 2.0)", "(0.5 + 0.125 * (step % 4))",
                        f"float(1.5 if {when} else 1.25)"])
    how = rng.choice(["h * {v}", "tf.multiply(h, {v})", "h / {v}"])
    return {"forward": [f"h = {how.format(v=value)}"]}


@feature("fresh_shape")
def fresh_shape(rng, tag, base):
    """A reshape there and back with the shape built at every step, as a tuple or a list,
    whose middle dimensions change at some steps."""
    a = rng.choice([2, 4])
    shape = rng.choice([f"(batch, {a}, H // {a})", f"[-1, {a}, H // {a}]",
                        f"(batch, {a} if {_every(rng)} else H // {a}, -1)"])
    return {"forward": [f"h = tf.reshape(tf.reshape(h, {shape}) * 1.0, (batch, H))"]}


@feature("list_multiples")
def list_multiples(rng, tag, base):
    """``tf.tile`` with its multiples a list built at every step, 2 or 3 at some steps, and
    the columns cut back to H."""
    return {"forward": [f"h = tf.tile(h, [1, 3 if {_every(rng)} else 2])[:, :H] * 0.5"]}


@feature("signed_zero")
def signed_zero(rng, tag, base):
    """A zero that is -0.0 at some steps and 0.0 at others, handed to an op as a float,
    converted by the operator's wrapper, or in a list (converted anew, not through TF's cache
    of scalars), and read by ``atan2``: pi or -pi in the loss."""
    z = f"(-0.0 if {_every(rng)} else 0.0)"
    how = rng.choice([f"tf.multiply(tf.ones([]), {z})", f"tf.ones([]) * {z}",
                      f"tf.constant([{z}, 1.0])[0]"])
    return {"loss": [f"{tag}_z = {how}",
                     f"loss = loss + 1e-3 * tf.math.atan2({tag}_z, -1.0)"]}


@feature("np_constant")
def np_constant(rng, tag, base):
    """A numpy array made at every step and written in place at some steps, handed to the
    op as it is or converted by the operator's wrapper."""
    how = rng.choice(["h * {w}", "tf.multiply(h, {w})"])
    return {"forward": [f"{tag}_w = np.linspace(0.5, 1.5, H, dtype=np.float32)",
                        f"if {_every(rng)}:\n    {tag}_w[0] = 2.0",
                        f"h = {how.format(w=tag + '_w')}"]}


@feature("mixed_list")
def mixed_list(rng, tag, base):
    """A list mixing ints and floats, made at every step, its values changing at some steps;
    or one list Python keeps and reverses in place at some steps (``tf.gather`` indices)."""
    return rng.choice([
        {"forward": [f"h = h + [(1 if i % 2 else 0.5) * (2 if {_every(rng)} else 1) "
                     f"for i in range(H)]"]},
        {"helpers": [f"{tag}_order = list(range(H))"],
         "forward": [f"if {_every(rng)}:\n    {tag}_order.reverse()",
                     f"h = tf.gather(h, {tag}_order, axis=1)"]},
    ])
