"""Small Faster R-CNN: conv backbone, region proposal network, RoI head; image sizes vary.

The anchor-target and proposal-target code is host code, as in many TF2 Faster R-CNN ports:
mid-step it turns tensors into Python numbers and numpy arrays (``int(tf.shape(...)[1])``,
``int(tf.size(keep))``, ``proposals.numpy()``), samples anchors and RoIs with numpy and feeds
the result back into the graph. AutoGraph cannot convert this (tensor materialization during
conversion, paper Table 3.1). Every batch has its own image size.
"""

import numpy as np
import tensorflow as tf

from benchmarks.programs.base import Program, keras


def iou_matrix(a, b):
    """IoU of every box in ``a`` [N, 4] with every box in ``b`` [M, 4] (y1, x1, y2, x2)."""
    tl = np.maximum(a[:, None, :2], b[None, :, :2])
    br = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(br - tl, 0, None).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).prod(-1)
    return inter / (area_a[:, None] + area_b[None, :] - inter)


def encode(boxes, reference):
    """Regression targets (dy, dx, dh, dw) of ``boxes`` relative to ``reference``."""
    h, w = reference[:, 2] - reference[:, 0], reference[:, 3] - reference[:, 1]
    cy, cx = reference[:, 0] + h / 2, reference[:, 1] + w / 2
    bh, bw = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    by, bx = boxes[:, 0] + bh / 2, boxes[:, 1] + bw / 2
    return np.stack([(by - cy) / h, (bx - cx) / w, np.log(bh / h), np.log(bw / w)], 1)


def decode(deltas, reference):
    h, w = reference[:, 2] - reference[:, 0], reference[:, 3] - reference[:, 1]
    cy, cx = reference[:, 0] + h / 2, reference[:, 1] + w / 2
    dy, dx, dh, dw = tf.unstack(deltas, axis=1)
    y, x = cy + dy * h, cx + dx * w
    bh, bw = h * tf.exp(tf.minimum(dh, 4.0)), w * tf.exp(tf.minimum(dw, 4.0))
    return tf.stack([y - bh / 2, x - bw / 2, y + bh / 2, x + bw / 2], 1)


def smooth_l1(pred, target):
    diff = tf.abs(pred - target)
    return tf.reduce_sum(tf.where(diff < 1.0, 0.5 * diff**2, diff - 0.5))


class FasterRCNN(Program):
    CONFIGS = {
        "quick": dict(sizes=((64, 64), (64, 96), (96, 64), (80, 80)), width=16, classes=3,
                      anchor_sizes=(12, 24, 40), rpn_batch=64, post_nms=64, roi_batch=32,
                      pool=7, n_batches=8),
        "large": dict(sizes=((192, 256), (256, 192), (224, 224), (256, 256)), width=32,
                      classes=8, anchor_sizes=(32, 64, 128), rpn_batch=256, post_nms=300,
                      roi_batch=128, pool=7, n_batches=8),
    }
    FEATURE = "int()/.numpy() on tensors mid-step (anchor/proposal targets); image size varies"
    AUTOGRAPH = "fails"
    STRIDE = 8
    RATIOS = (0.5, 1.0, 2.0)

    def build(self):
        c = self.cfg
        w = c.width
        self.backbone = keras.Sequential([
            keras.Input((None, None, 3)),
            keras.layers.Conv2D(w, 3, strides=2, padding="same", activation="relu"),
            keras.layers.Conv2D(2 * w, 3, strides=2, padding="same", activation="relu"),
            keras.layers.Conv2D(4 * w, 3, strides=2, padding="same", activation="relu"),
            keras.layers.Conv2D(4 * w, 3, padding="same", activation="relu"),
        ])
        n_anchors = len(c.anchor_sizes) * len(self.RATIOS)
        self.rpn_conv = keras.layers.Conv2D(4 * w, 3, padding="same", activation="relu")
        self.rpn_cls = keras.layers.Conv2D(n_anchors, 1)
        self.rpn_reg = keras.layers.Conv2D(4 * n_anchors, 1, kernel_initializer="zeros")
        self.head = keras.Sequential([
            keras.Input((c.pool, c.pool, 4 * w)),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
        ])
        self.head_cls = keras.layers.Dense(c.classes + 1)
        self.head_reg = keras.layers.Dense(4, kernel_initializer="zeros")
        features = self.backbone(tf.zeros((1, 64, 64, 3)))
        hidden = self.rpn_conv(features)
        self.rpn_cls(hidden), self.rpn_reg(hidden)
        self.head_cls.build((None, 128)), self.head_reg.build((None, 128))
        self.trainable_variables = [
            v for layer in (self.backbone, self.rpn_conv, self.rpn_cls, self.rpn_reg, self.head,
                            self.head_cls, self.head_reg) for v in layer.trainable_variables]
        self.optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        self.data = [self.synthetic_image(c.sizes[i % len(c.sizes)]) for i in range(c.n_batches)]

    def synthetic_image(self, size):
        h, w = size
        image = self.rng.uniform(0, 0.3, size=(1, h, w, 3)).astype(np.float32)
        n = int(self.rng.integers(1, 4))
        boxes, classes = np.zeros((n, 4), np.float32), np.zeros(n, np.int32)
        for i in range(n):
            bh, bw = self.rng.uniform(10, h * 0.6), self.rng.uniform(10, w * 0.6)
            y1, x1 = self.rng.uniform(0, h - bh), self.rng.uniform(0, w - bw)
            boxes[i] = (y1, x1, y1 + bh, x1 + bw)
            classes[i] = self.rng.integers(0, self.cfg.classes)
            image[0, int(y1):int(y1 + bh), int(x1):int(x1 + bw), classes[i] % 3] += 0.7
        return tf.constant(image), tf.constant(boxes), tf.constant(classes)

    def anchor_grid(self, h, w):
        """Anchors (y1, x1, y2, x2) of an h x w feature map, in pixels."""
        shapes = np.array([(s * r**0.5, s / r**0.5) for s in self.cfg.anchor_sizes
                           for r in self.RATIOS], np.float32)  # (height, width)
        cy, cx = np.meshgrid((np.arange(h) + 0.5) * self.STRIDE,
                             (np.arange(w) + 0.5) * self.STRIDE, indexing="ij")
        centres = np.stack([cy, cx], -1).reshape(-1, 1, 2)
        return np.concatenate([centres - shapes / 2, centres + shapes / 2], -1).reshape(-1, 4)

    def anchor_targets(self, anchors, gt_boxes):
        """RPN labels (1 object, 0 background, -1 ignored) and box targets, subsampled."""
        overlaps = iou_matrix(anchors, gt_boxes)
        best = overlaps.max(1)
        labels = np.full(len(anchors), -1, np.int32)
        labels[best < 0.3] = 0
        labels[overlaps.argmax(0)] = 1
        labels[best >= 0.7] = 1
        positives = np.flatnonzero(labels == 1)
        n_pos = self.cfg.rpn_batch // 2
        if len(positives) > n_pos:
            labels[self.rng.choice(positives, len(positives) - n_pos, replace=False)] = -1
        negatives = np.flatnonzero(labels == 0)
        n_neg = self.cfg.rpn_batch - int((labels == 1).sum())
        if len(negatives) > n_neg:
            labels[self.rng.choice(negatives, len(negatives) - n_neg, replace=False)] = -1
        targets = encode(gt_boxes[overlaps.argmax(1)], anchors).astype(np.float32)
        return labels, targets

    def proposal_targets(self, proposals, gt_boxes, gt_classes):
        """Sampled RoIs with their class labels (0 = background) and box targets."""
        rois = np.concatenate([proposals, gt_boxes], 0)
        overlaps = iou_matrix(rois, gt_boxes)
        best, match = overlaps.max(1), overlaps.argmax(1)
        foreground, background = np.flatnonzero(best >= 0.5), np.flatnonzero(best < 0.5)
        n_fg = min(len(foreground), self.cfg.roi_batch // 4)
        n_bg = min(len(background), self.cfg.roi_batch - n_fg)
        keep = np.concatenate([self.rng.choice(foreground, n_fg, replace=False),
                               self.rng.choice(background, n_bg, replace=False)])
        labels = np.where(best[keep] >= 0.5, gt_classes[match[keep]] + 1, 0).astype(np.int32)
        targets = encode(gt_boxes[match[keep]], rois[keep]).astype(np.float32)
        return rois[keep].astype(np.float32), labels, targets, n_fg

    def train_step(self, image, gt_boxes, gt_classes):
        with self.tape() as tape:
            features = self.backbone(image, training=True)
            hidden = self.rpn_conv(features)
            rpn_logits = tf.reshape(self.rpn_cls(hidden), [-1])
            rpn_deltas = tf.reshape(self.rpn_reg(hidden), [-1, 4])

            # RPN loss on sampled anchors (host code).
            h, w = int(tf.shape(features)[1]), int(tf.shape(features)[2])
            anchors = self.anchor_grid(h, w)
            labels, targets = self.anchor_targets(anchors, gt_boxes.numpy())
            sampled, positive = np.flatnonzero(labels >= 0), np.flatnonzero(labels == 1)
            rpn_cls_loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=tf.constant(labels[sampled], tf.float32),
                logits=tf.gather(rpn_logits, sampled)))
            rpn_box_loss = smooth_l1(tf.gather(rpn_deltas, positive),
                                     targets[positive]) / len(sampled)

            # Proposals: decode, clip, NMS; then sample RoIs against the ground truth (host).
            image_h, image_w = image.shape[1], image.shape[2]
            boxes = decode(tf.stop_gradient(rpn_deltas), anchors)
            boxes = tf.clip_by_value(boxes, 0.0, [image_h, image_w, image_h, image_w])
            keep = tf.image.non_max_suppression(boxes, tf.sigmoid(rpn_logits),
                                                self.cfg.post_nms, iou_threshold=0.7)
            num_proposals = int(tf.size(keep))
            proposals = tf.gather(boxes, keep).numpy()[:num_proposals]
            rois, roi_labels, roi_targets, n_fg = self.proposal_targets(
                proposals, gt_boxes.numpy(), gt_classes.numpy())

            # RoI head.
            scale = np.array([image_h, image_w, image_h, image_w], np.float32)
            pooled = tf.image.crop_and_resize(features, rois / scale, np.zeros(len(rois), np.int32),
                                              (self.cfg.pool, self.cfg.pool))
            head = self.head(pooled, training=True)
            cls_logits, box_deltas = self.head_cls(head), self.head_reg(head)
            head_cls_loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=roi_labels, logits=cls_logits))
            head_box_loss = smooth_l1(box_deltas[:n_fg], roi_targets[:n_fg]) / len(rois)
            loss = rpn_cls_loss + rpn_box_loss + head_cls_loss + head_box_loss
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return loss
