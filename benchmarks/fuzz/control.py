"""Features that change the op path from step to step: Python control flow and shapes.

Each one is the kind of code Terra must follow by tracing: branches on a step counter, on a
value fetched from the graph, on Python's ``random``, on an attribute mutated between steps;
loops whose trip count varies; exceptions, generators and recursion choosing the ops; steps
skipped or the loop left early; batch size and sequence length changing per step.
"""

from .snippets import feature


def _pick_op(rng):
    """A shape-preserving transformation of ``h``, as an expression."""
    return rng.choice(["tf.nn.relu(h)", "tf.tanh(h) * 1.5", "h - tf.reduce_mean(h, axis=0)",
                       "h * tf.sigmoid(h)", "tf.nn.softplus(h) - 0.5", "h / (1.0 + tf.abs(h))"])


@feature("if_counter")
def if_counter(rng, tag, base):
    k = rng.choice([2, 3, 4])
    r = rng.randrange(k)
    return {"forward": [f"if step % {k} == {r}:\n    h = {_pick_op(rng)}\n"
                        f"else:\n    h = h * {rng.choice([0.5, 0.9, 1.1])}"]}


@feature("if_fetched")
def if_fetched(rng, tag, base):
    threshold = round(rng.uniform(0.2, 0.7), 2)
    reduce = rng.choice(["tf.reduce_mean(tf.abs(h))", "tf.reduce_max(h)", "tf.math.reduce_std(h)"])
    return {"forward": [f"if float({reduce}) > {threshold}:\n    h = {_pick_op(rng)}"]}


@feature("if_loss_outside")
def if_loss_outside(rng, tag, base):
    """A decision taken on the fetched loss after the step, acted on in the next one."""
    threshold = round(rng.uniform(0.3, 1.5), 2)
    return {"helpers": [f"state.{tag}_scale = 1.0"],
            "forward": [f"h = h * state.{tag}_scale"],
            "after": [f"state.{tag}_scale = 0.5 if float(loss) > {threshold} else 1.0"]}


@feature("if_random")
def if_random(rng, tag, base):
    p = round(rng.uniform(0.3, 0.7), 2)
    return {"forward": [f"if random.random() < {p}:\n    h = {_pick_op(rng)}"]}


@feature("random_blocks")
def random_blocks(rng, tag, base):
    """Independent random choices on separate lines, each side reading one fixed eager
    tensor: the gradient call meets combinations of branches no trace took (one recorded
    region per combination until Terra folds them into one), and a captured tensor is read
    in both branches of a switch-case (65-128 values: TF captures it as a constant)."""
    size = rng.choice([16, 80, 120])
    helpers = [f"{tag}_scale = tf.constant(np.linspace(0.5, 1.5, {size}, dtype=np.float32))"]
    forward = []
    for _ in range(rng.choice([2, 3])):
        p = round(rng.uniform(0.3, 0.7), 2)
        forward.append(f"if random.random() < {p}:\n"
                       f"    h = ({_pick_op(rng)}) * tf.reduce_mean({tag}_scale)\n"
                       f"else:\n    h = ({_pick_op(rng)}) + 0.1 * tf.reduce_max({tag}_scale)")
    return {"helpers": helpers, "forward": forward}


@feature("if_attribute")
def if_attribute(rng, tag, base):
    inc = rng.choice([1, 2])
    return {"helpers": [f"state.{tag}_mode = 0"],
            "forward": [f"if state.{tag}_mode == 1:\n    h = {_pick_op(rng)}\n"
                        f"elif state.{tag}_mode == 2:\n    h = {_pick_op(rng)}"],
            "after": [f"state.{tag}_mode = (state.{tag}_mode + {inc}) % 3"]}


@feature("for_trips")
def for_trips(rng, tag, base):
    trips = rng.choice([f"1 + step % {rng.choice([2, 3])}", "random.randint(0, 2)",
                        f"(step * {rng.choice([3, 5])}) % 4"])
    return {"helpers": [f"{tag}_m = tf.Variable(np.eye(H, dtype=np.float32) * 0.5)",
                        f"extra.append({tag}_m)"],
            "forward": [f"for _ in range({trips}):\n    h = tf.tanh(h @ {tag}_m) + 0.5 * h"]}


@feature("while_fetched")
def while_fetched(rng, tag, base):
    threshold = round(rng.uniform(0.3, 0.9), 2)
    return {"forward": [f"{tag}_n = 0",
                        f"while {tag}_n < 3 and float(tf.reduce_max(tf.abs(h))) > {threshold}:\n"
                        f"    h = h * 0.7\n    {tag}_n += 1"]}


@feature("try_except")
def try_except(rng, tag, base):
    k = rng.choice([2, 3, 4])
    condition = rng.choice([f"step % {k} == {rng.randrange(k)}",
                            f"float(tf.reduce_mean(h)) > {round(rng.uniform(-0.1, 0.1), 2)}"])
    return {"helpers": [f"def {tag}_risky(h, step):\n    if {condition}:\n"
                        f"        raise ValueError('refused')\n    return h * 1.1"],
            "forward": [f"try:\n    h = {tag}_risky(h, step)\nexcept ValueError:\n"
                        f"    h = {_pick_op(rng)}"]}


@feature("generator")
def generator(rng, tag, base):
    m = rng.choice([2, 3])
    return {"helpers": [f"def {tag}_scales(n):\n    for i in range(n):\n"
                        f"        yield 1.0 / (i + 2)"],
            "forward": [f"for {tag}_s in {tag}_scales(1 + step % {m}):\n"
                        f"    h = h + {tag}_s * tf.sin(h)"]}


@feature("recursion")
def recursion(rng, tag, base):
    a, m = rng.choice([1, 3, 7]), rng.choice([2, 3, 4])
    return {"helpers": [f"def {tag}_deep(h, depth):\n    if depth == 0:\n        return h\n"
                        f"    return {tag}_deep(tf.tanh(h) + 0.5 * h, depth - 1)"],
            "forward": [f"h = {tag}_deep(h, (step * {a}) % {m})"]}


@feature("skip_step")
def skip_step(rng, tag, base):
    k = rng.choice([4, 5, 7])
    r = rng.randrange(1, k)
    where = rng.choice(["top", "grads"])  # before the tape, or between gradient and update
    return {where: [f"if step % {k} == {r}:\n    continue"]}


@feature("break_early")
def break_early(rng, tag, base):
    condition = rng.choice([f"step == STEPS - {rng.choice([2, 3])}",
                            f"step > 8 and float(loss) < {round(rng.uniform(0.05, 0.4), 2)}"])
    return {"after": [f"if {condition}:\n    break"]}


@feature("vary_batch")
def vary_batch(rng, tag, base):
    sizes = tuple(rng.sample([3, 4, 6, 8, 12], rng.choice([2, 3])))
    pick = rng.choice([f"{sizes}[step % {len(sizes)}]", f"random.choice({sizes})"])
    return {"shape": [f"batch = {pick}"]}


@feature("vary_seq", fits=lambda base: base.inputs != "dense")
def vary_seq(rng, tag, base):
    pick = rng.choice(["2 + step % 3", "random.randint(2, 5)", "(3, 5)[step % 2]"])
    return {"shape": [f"seq = {pick}"]}


@feature("adversarial_input", fits=lambda base: base.inputs != "tokens")
def adversarial_input(rng, tag, base):
    """A first, separate tape perturbs the batch along its input gradient (FGSM): two
    outermost tapes in one step, so Terra's iteration boundary falls inside the step."""
    return {"top": [f"with tape_cls() as {tag}_adv:\n    {tag}_adv.watch(x)\n"
                    f"    {tag}_l = tf.reduce_mean(tf.square(model.head("
                    f"model.encode(x, training=False))))",
                    f"x = x + {rng.choice([0.01, 0.05])} * "
                    f"tf.sign({tag}_adv.gradient({tag}_l, x))"]}


@feature("tf_function")
def tf_function(rng, tag, base):
    """A helper compiled with tf.function, called eagerly inside the tape (one call op)."""
    body = rng.choice(["return tf.tanh(t) + 0.1 * t", "return t * tf.sigmoid(t)"])
    return {"helpers": [f"@tf.function\ndef {tag}_fn(t):\n    {body}"],
            "forward": [f"h = {tag}_fn(h)"]}


@feature("dataset_iterator", fits=lambda base: base.inputs == "dense")
def dataset_iterator(rng, tag, base):
    """Part of each batch comes from a tf.data iterator: iterator ops run in Python."""
    return {"helpers": [f"{tag}_it = iter(tf.data.Dataset.from_tensor_slices(\n"
                        f"    np.random.default_rng(1).standard_normal((60, D)).astype(np.float32))"
                        f"\n    .batch(12, drop_remainder=True).repeat())"],
            "top": [f"x = x + 0.1 * next({tag}_it)[:batch]"]}


@feature("masked_loss")
def masked_loss(rng, tag, base):
    """A loss term over the rows a data-dependent mask keeps, as a detector's loss selects its
    responsible cells: the row count changes every step, so the graph computes that gradient
    itself (a symbolic region from a graph tape) rather than replaying recorded ops."""
    threshold = round(rng.uniform(-0.2, 0.3), 2)
    return {"loss": [f"{tag}_keep = tf.reduce_max(logits, axis=-1) > {threshold}",
                     f"loss = loss + {rng.choice([0.1, 0.5])} * tf.reduce_sum(tf.square("
                     f"tf.boolean_mask(logits, {tag}_keep))) / 8.0"]}


@feature("fan_out")
def fan_out(rng, tag, base):
    """One value read by several terms summed by ``tf.add_n``: its gradient adds as many
    contributions, in an order that decides the last bits, and so does the sum."""
    terms = ["tf.tanh(h)", "h * 0.5", "tf.nn.relu(h)", "h * h * 0.1", "tf.sigmoid(h) - 0.5",
             "tf.abs(h) * 0.2", "h - tf.stop_gradient(tf.reduce_mean(h, axis=0))"]
    picked = [rng.choice(terms) for _ in range(rng.choice([3, 5, 11]))]
    return {"forward": [f"h = tf.add_n([{', '.join(picked)}]) / {float(len(picked))}"]}
