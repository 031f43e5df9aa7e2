"""Features around values and state: materialization, mutation, escapes, tapes, gradients.

These reach the parts of Terra that move values between Python and the graph: fetches
(``.numpy()``, ``float()``, ``int(tf.shape(...))``, ``print``), values computed in numpy and
fed back, tensors that outlive their iteration, variables assigned outside the optimizer or
created mid-run, optimizer and learning-rate changes, and every way of holding a tape.
"""

from .snippets import feature


@feature("numpy_feedback")
def numpy_feedback(rng, tag, base):
    stat = rng.choice(["np.abs({a}).mean()", "{a}.std()", "np.median({a})"])
    return {"forward": [f"{tag}_a = h.numpy()",
                        f"{tag}_s = np.float32({stat.format(a=tag + '_a')} + 1.0)",
                        f"h = h / tf.constant({tag}_s)"]}


@feature("int_shape")
def int_shape(rng, tag, base):
    return rng.choice([
        {"loss": [f"{tag}_n = int(tf.shape(x)[0])", f"loss = loss * (8.0 / {tag}_n)"]},
        {"forward": ["h = tf.reshape(h, (int(tf.shape(h)[0]), -1))"]},
    ])


@feature("print_tensor")
def print_tensor(rng, tag, base):
    what = rng.choice(["loss", "tf.reduce_mean(h, axis=0)[:2]", "grads[-1]"])
    return {"after": [f"print('step', step, {what}, file=log)"]}


@feature("numpy_roundtrip")
def numpy_roundtrip(rng, tag, base):
    """A value fetched after the step, transformed in numpy, fed back as a tensor next step."""
    return {"helpers": [f"state.{tag}_bias = None"],
            "forward": [f"if state.{tag}_bias is not None:\n    h = h + state.{tag}_bias"],
            "after": [f"state.{tag}_bias = tf.constant("
                      f"np.tanh(h.numpy().mean(axis=0)) * 0.1, dtype=tf.float32)"]}


@feature("list_append")
def list_append(rng, tag, base):
    return {"helpers": [f"{tag}_history = []"],
            "loss": [f"{tag}_history.append(tf.reduce_mean(tf.square(h)))",
                     f"if len({tag}_history) > 2:\n"
                     f"    loss = loss + 0.01 * tf.add_n({tag}_history[-3:])"]}


@feature("attr_tensor")
def attr_tensor(rng, tag, base):
    return {"helpers": [f"state.{tag}_prev = None"],
            "forward": [f"if state.{tag}_prev is not None:\n"
                        f"    h = h - 0.1 * state.{tag}_prev"],
            "after": [f"state.{tag}_prev = tf.reduce_mean(h, axis=0)"]}


@feature("assign_outside")
def assign_outside(rng, tag, base):
    k = rng.choice([2, 3, 4])
    change = rng.choice(["params[0].assign(params[0] * 0.99)",
                         "params[-1].assign_add(tf.fill(params[-1].shape, 0.001))",
                         "params[0].assign_sub(0.01 * tf.sign(params[0]))"])
    return {"after": [f"if step % {k} == {rng.randrange(k)}:\n    {change}"]}


@feature("cond_l2")
def cond_l2(rng, tag, base):
    k = rng.choice([2, 3])
    which = rng.choice(["params[0]", "params[-1]"])
    return {"loss": [f"if step % {k} == 0:\n"
                     f"    loss = loss + 1e-3 * tf.reduce_sum(tf.square({which}))"]}


@feature("lazy_variable")
def lazy_variable(rng, tag, base):
    k = rng.choice([2, 4, 6, 8])
    return {"helpers": [f"state.{tag}_v = None"],
            "top": [f"if step == {k}:\n    state.{tag}_v = tf.Variable(tf.fill([H], 0.1))\n"
                    f"    extra.append(state.{tag}_v)"],
            "forward": [f"if state.{tag}_v is not None:\n    h = h * state.{tag}_v + h"]}


@feature("lr_change")
def lr_change(rng, tag, base):
    k = rng.choice([3, 5, 7, 9])
    if base.optimizer == "manual":
        change = "lr = lr * 0.5"
    else:
        change = rng.choice(["optimizer.learning_rate = 0.02",
                             "optimizer.learning_rate.assign(0.005)"])
    condition = rng.choice([f"step == {k}", f"float(loss) > {round(rng.uniform(0.5, 2), 2)}"])
    return {"after": [f"if {condition}:\n    {change}"]}


@feature("optimizer_swap", fits=lambda base: base.optimizer != "manual")
def optimizer_swap(rng, tag, base):
    make = rng.choice(["SGD(0.02)", "Adam(0.005)", "SGD(0.02, momentum=0.5)"])
    built = rng.random() < 0.5  # an unbuilt optimizer creates its slots mid-run
    return {"helpers": [f"{tag}_next = K.optimizers.{make}", f"optimizers.append({tag}_next)"]
            + ([f"{tag}_next.build(params)"] if built else []),
            "after": [f"if step == {rng.choice([4, 6, 9])}:\n    optimizer = {tag}_next"]}


@feature("escape")
def escape(rng, tag, base):
    later = rng.random() < 0.5  # kept tensors feed a later step, or are only read at the end
    return {"helpers": [f"{tag}_kept = []"],
            "after": [f"{tag}_kept.append(tf.reduce_mean(h, axis=0))"],
            "end": [f"out['{tag}'] = [t.numpy() for t in {tag}_kept]"],
            **({"forward": [f"if len({tag}_kept) > 3:\n    h = h + 0.05 * {tag}_kept[-3]"]}
               if later else {})}


@feature("second_tape")
def second_tape(rng, tag, base):
    return {"tape_with": [f"tape_cls() as {tag}_tape"],
            "loss": [f"{tag}_aux = 0.01 * tf.reduce_mean(tf.square(h))"],
            "grads": [f"{tag}_g = {tag}_tape.gradient({tag}_aux, params[:1])",
                      f"sgd(zip({tag}_g, params[:1]), 0.01)"]}


@feature("persistent_tape")
def persistent_tape(rng, tag, base):
    return {"tape_args": ["persistent=True"],
            "loss": [f"{tag}_aux = 0.01 * tf.reduce_mean(tf.square(logits))"],
            "grads": [f"{tag}_g = tape.gradient({tag}_aux, params)",
                      f"grads = [add_grads(a, b) for a, b in zip(grads, {tag}_g)]"]}


@feature("nested_tape")
def nested_tape(rng, tag, base):
    return {"forward": [f"with tape_cls() as {tag}_inner:\n    {tag}_inner.watch(h)\n"
                        f"    {tag}_o = tf.reduce_sum(tf.tanh(h) ** 2)",
                        f"h = h + 0.1 * {tag}_inner.gradient({tag}_o, h)"]}


@feature("stop_gradient")
def stop_gradient(rng, tag, base):
    return {"forward": [f"h = h + tf.stop_gradient(tf.tanh(h) - h) * "
                        f"{rng.choice([0.3, 0.5, 1.0])}"]}


@feature("custom_gradient")
def custom_gradient(rng, tag, base):
    bound = rng.choice([0.01, 0.05, 0.2])
    return {"helpers": [f"@tf.custom_gradient\ndef {tag}_clip(t):\n    def grad(dy):\n"
                        f"        return tf.clip_by_value(dy, -{bound}, {bound})\n"
                        f"    return tf.identity(t), grad"],
            "forward": [f"h = {tag}_clip(h)"]}


@feature("grad_clip")
def grad_clip(rng, tag, base):
    return rng.choice([
        {"grads": ["grads = [None if g is None else tf.clip_by_norm(tf.convert_to_tensor(g), 1.0)"
                   " for g in grads]"]},
        {"grads": [f"grads, {tag}_norm = tf.clip_by_global_norm(grads, 0.5)",
                   f"out.setdefault('{tag}_norms', []).append(float({tag}_norm))"]},
    ])


@feature("random_noise")
def random_noise(rng, tag, base):
    """Stateful random ops, which Terra runs in Python: a fallback must not draw them twice."""
    return {"forward": [rng.choice(["h = h + 0.01 * tf.random.normal(tf.shape(h))",
                                    "h = h * tf.random.uniform(tf.shape(h), 0.9, 1.1)"])]}


@feature("counter_variable")
def counter_variable(rng, tag, base):
    """A non-trainable counter variable, bumped outside the tape and read back as a Python int."""
    return {"helpers": [f"{tag}_count = tf.Variable(0)"],
            "forward": [f"if int({tag}_count) % {rng.choice([2, 3])} == 1:\n"
                        f"    h = h * 0.8"],
            "after": [f"{tag}_count.assign_add(1)"]}


@feature("grad_accumulate")
def grad_accumulate(rng, tag, base):
    """Gradients of one step kept and added to the next: tensors that outlive their iteration."""
    return {"helpers": [f"state.{tag}_acc = None"],
            "grads": [f"if state.{tag}_acc is not None:\n"
                      f"    grads = [add_grads(a, b) for a, b in zip(grads, state.{tag}_acc)]\n"
                      f"    state.{tag}_acc = None\n"
                      f"elif step % 2 == 0:\n"
                      f"    state.{tag}_acc = grads"]}
