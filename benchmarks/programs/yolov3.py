"""Small YOLOv3: Darknet-style residual backbone, three detection scales, YOLO loss.

The loss decodes boxes per scale, selects responsible anchors and the ignore set with boolean
masks (``tf.boolean_mask``, i.e. ``Where``), and the upsampling path uses nearest-neighbour
resizing. The step returns its loss terms and, like the original loop, the loop body logs them
with ``.numpy()`` after every step (``after_step``): under Terra these are fetches. AutoGraph
handles the step (the logging is outside it); the paper found XLA clusters this model poorly.
"""

import logging
import math

import numpy as np
import tensorflow as tf

from benchmarks.programs.base import Program, keras

log = logging.getLogger(__name__)

NUM_ANCHORS = 3
# Anchor (w, h) in pixels per scale, small -> large (input 64x64: strides 8, 16, 32).
ANCHORS = np.array([[[6, 8], [10, 12], [12, 8]],
                    [[16, 20], [20, 14], [24, 24]],
                    [[32, 28], [40, 40], [56, 48]]], np.float32)
STRIDES = (8, 16, 32)


def conv(x, filters, size, strides=1, bn=True):
    x = keras.layers.Conv2D(filters, size, strides=strides, padding="same",
                            use_bias=not bn)(x)
    if bn:
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.LeakyReLU(0.1)(x)
    return x


def residual(x, filters):
    short = x
    x = conv(x, filters // 2, 1)
    x = conv(x, filters, 3)
    return keras.layers.Add()([short, x])


def darknet_yolo(size, width, classes):
    inputs = keras.Input((size, size, 3))
    x = conv(inputs, width, 3)
    x = residual(conv(x, 2 * width, 3, strides=2), 2 * width)              # /2
    x = residual(conv(x, 4 * width, 3, strides=2), 4 * width)              # /4
    route_1 = residual(conv(x, 4 * width, 3, strides=2), 4 * width)        # /8
    route_2 = residual(conv(route_1, 8 * width, 3, strides=2), 8 * width)  # /16
    x = residual(conv(route_2, 8 * width, 3, strides=2), 8 * width)        # /32
    out_channels = NUM_ANCHORS * (5 + classes)

    large = conv(x, 8 * width, 1)
    out_l = conv(conv(large, 8 * width, 3), out_channels, 1, bn=False)
    x = keras.layers.UpSampling2D(2, interpolation="nearest")(conv(large, 4 * width, 1))
    medium = conv(keras.layers.Concatenate()([x, route_2]), 4 * width, 1)
    out_m = conv(conv(medium, 8 * width, 3), out_channels, 1, bn=False)
    x = keras.layers.UpSampling2D(2, interpolation="nearest")(conv(medium, 2 * width, 1))
    small = conv(keras.layers.Concatenate()([x, route_1]), 2 * width, 1)
    out_s = conv(conv(small, 4 * width, 3), out_channels, 1, bn=False)
    return keras.Model(inputs, [out_s, out_m, out_l])


def box_iou(a, b, giou=False):
    """IoU (or GIoU) of boxes (cx, cy, w, h), broadcast against each other."""
    a_min, a_max = a[..., :2] - a[..., 2:] / 2, a[..., :2] + a[..., 2:] / 2
    b_min, b_max = b[..., :2] - b[..., 2:] / 2, b[..., :2] + b[..., 2:] / 2
    inter = tf.reduce_prod(tf.maximum(tf.minimum(a_max, b_max) - tf.maximum(a_min, b_min), 0.0),
                           axis=-1)
    union = tf.reduce_prod(a[..., 2:], -1) + tf.reduce_prod(b[..., 2:], -1) - inter
    iou = inter / (union + 1e-9)
    if not giou:
        return iou
    enclose = tf.reduce_prod(tf.maximum(a_max, b_max) - tf.minimum(a_min, b_min), axis=-1)
    return iou - (enclose - union) / (enclose + 1e-9)


class YOLOv3(Program):
    CONFIGS = {
        "quick": dict(batch=4, size=64, width=8, classes=4, max_boxes=4, n_batches=8),
        "large": dict(batch=8, size=128, width=16, classes=20, max_boxes=8, n_batches=8),
    }
    FEATURE = "boolean-mask loss, nearest upsampling, .numpy() logging in the loop"

    def build(self):
        c = self.cfg
        self.model = darknet_yolo(c.size, c.width, c.classes)
        self.anchors = ANCHORS * (c.size / 64)
        self.lr_init, self.lr_end = 1e-4, 1e-6
        self.optimizer = keras.optimizers.Adam(self.lr_init)
        self.global_steps = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.warmup_steps, self.total_steps = 20, 1000
        self.step = 0
        self.data = [self.synthetic_batch() for _ in range(c.n_batches)]

    def synthetic_batch(self):
        """Images with bright rectangles; YOLO targets per scale and the raw boxes."""
        c = self.cfg
        images = self.rng.uniform(0, 0.2, size=(c.batch, c.size, c.size, 3)).astype(np.float32)
        labels = [np.zeros((c.batch, c.size // s, c.size // s, NUM_ANCHORS, 5 + c.classes),
                           np.float32) for s in STRIDES]
        boxes = np.zeros((c.batch, c.max_boxes, 4), np.float32)
        flat_anchors = self.anchors.reshape(-1, 2)
        for i in range(c.batch):
            for j in range(int(self.rng.integers(1, c.max_boxes + 1))):
                w, h = self.rng.uniform(c.size * 0.1, c.size * 0.8, size=2)
                cx = self.rng.uniform(w / 2, c.size - w / 2)
                cy = self.rng.uniform(h / 2, c.size - h / 2)
                cls = int(self.rng.integers(0, c.classes))
                x0, y0 = int(cx - w / 2), int(cy - h / 2)
                images[i, y0:int(y0 + h), x0:int(x0 + w), cls % 3] = 1.0
                boxes[i, j] = (cx, cy, w, h)
                # The anchor with the best shape IoU is responsible for the box.
                inter = np.minimum(flat_anchors, [w, h]).prod(1)
                best = int(np.argmax(inter / (flat_anchors.prod(1) + w * h - inter)))
                scale, a = divmod(best, NUM_ANCHORS)
                gx, gy = int(cx // STRIDES[scale]), int(cy // STRIDES[scale])
                labels[scale][i, gy, gx, a, :4] = (cx, cy, w, h)
                labels[scale][i, gy, gx, a, 4] = 1.0
                labels[scale][i, gy, gx, a, 5 + cls] = 1.0
        return (tf.constant(images), *(tf.constant(t) for t in labels), tf.constant(boxes))

    def scale_loss(self, conv_out, label, boxes, scale):
        c = self.cfg
        grid = c.size // STRIDES[scale]
        out = tf.reshape(conv_out, (-1, grid, grid, NUM_ANCHORS, 5 + c.classes))
        raw_xy, raw_wh, raw_conf, raw_prob = tf.split(out, (2, 2, 1, c.classes), axis=-1)
        gy, gx = tf.meshgrid(tf.range(grid), tf.range(grid), indexing="ij")
        xy_grid = tf.cast(tf.stack([gx, gy], -1)[None, :, :, None, :], tf.float32)
        pred_xy = (tf.sigmoid(raw_xy) + xy_grid) * STRIDES[scale]
        pred_wh = tf.exp(tf.clip_by_value(raw_wh, -6.0, 6.0)) * self.anchors[scale]
        pred_box = tf.concat([pred_xy, pred_wh], -1)

        obj_mask = label[..., 4] > 0.5
        # Box and class terms only for responsible anchors.
        true_box = tf.boolean_mask(label[..., :4], obj_mask)
        resp_box = tf.boolean_mask(pred_box, obj_mask)
        box_scale = 2.0 - true_box[:, 2] * true_box[:, 3] / float(c.size**2)
        giou_loss = tf.reduce_sum(box_scale * (1.0 - box_iou(resp_box, true_box, giou=True)))
        prob_loss = tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
            labels=tf.boolean_mask(label[..., 5:], obj_mask),
            logits=tf.boolean_mask(raw_prob, obj_mask)))
        # Background anchors overlapping a ground-truth box well are ignored.
        best_iou = tf.reduce_max(
            box_iou(pred_box[:, :, :, :, None, :], boxes[:, None, None, None, :, :]), axis=-1)
        background = tf.logical_and(tf.logical_not(obj_mask), best_iou < 0.5)
        conf_logits = raw_conf[..., 0]
        conf_loss = (
            tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=tf.ones_like(tf.boolean_mask(conf_logits, obj_mask)),
                logits=tf.boolean_mask(conf_logits, obj_mask)))
            + tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=tf.zeros_like(tf.boolean_mask(conf_logits, background)),
                logits=tf.boolean_mask(conf_logits, background))))
        n = float(c.batch)
        return giou_loss / n, conf_loss / n, prob_loss / n

    def train_step(self, images, label_s, label_m, label_l, boxes):
        with self.tape() as tape:
            outputs = self.model(images, training=True)
            giou_loss = conf_loss = prob_loss = 0.0
            for scale, label in enumerate((label_s, label_m, label_l)):
                g, cf, p = self.scale_loss(outputs[scale], label, boxes, scale)
                giou_loss, conf_loss, prob_loss = giou_loss + g, conf_loss + cf, prob_loss + p
            total_loss = giou_loss + conf_loss + prob_loss
        gradients = tape.gradient(total_loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables, strict=True))
        # Warm-up then cosine learning rate, as tensors (the original's schedule).
        self.global_steps.assign_add(1)
        steps = tf.cast(self.global_steps, tf.float32)
        lr = tf.where(
            steps < self.warmup_steps, steps / self.warmup_steps * self.lr_init,
            self.lr_end + 0.5 * (self.lr_init - self.lr_end) * (1 + tf.cos(
                (steps - self.warmup_steps) / (self.total_steps - self.warmup_steps) * math.pi)))
        self.optimizer.learning_rate.assign(lr)
        return total_loss, giou_loss, conf_loss, prob_loss

    def after_step(self, out):
        total_loss, giou_loss, conf_loss, prob_loss = out
        self.step += 1
        log.info("=> STEP %4d   lr: %.6f   giou_loss: %4.2f   conf_loss: %4.2f   "
                 "prob_loss: %4.2f   total_loss: %4.2f", self.step,
                 self.optimizer.learning_rate.numpy(), giou_loss.numpy(), conf_loss.numpy(),
                 prob_loss.numpy(), total_loss.numpy())
        return total_loss
