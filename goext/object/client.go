package object

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/kvbm/kvbm/goext/integrity"
)

// ClientOptions locate one bucket.
type ClientOptions struct {
	Host      string // host[:port]
	Secure    bool   // https
	Region    string
	Bucket    string
	AccessKey string // both empty: anonymous requests
	SecretKey string
	// MaxConns bounds the connections kept to the server (0: 64).
	MaxConns int
}

// ErrNotFound: no object under the key.
var ErrNotFound = errors.New("object: G4 object not found")

// Client is a small S3 client for one bucket: conditional PUT, GET, HEAD,
// DELETE. It is built on minio-go (Apache-2.0), which speaks plain S3 (AWS
// Signature V4, path- or virtual-host style) to any compatible server (AWS
// S3, Ceph RGW, MinIO, SeaweedFS, versitygw) with few dependencies, and lets
// a PUT carry If-None-Match.
type Client struct {
	mc     *minio.Client
	bucket string
	secret string // the S3 secret key: a Store's MAC key derives from it by default
}

// NewClient creates the client; it does not contact the server.
func NewClient(o ClientOptions) (*Client, error) {
	if o.Host == "" || o.Bucket == "" {
		return nil, errors.New("object: client: host and bucket are required")
	}
	var creds *credentials.Credentials
	if o.AccessKey != "" || o.SecretKey != "" {
		creds = credentials.NewStaticV4(o.AccessKey, o.SecretKey, "")
	} else {
		creds = credentials.New(&credentials.Static{}) // anonymous
	}
	conns := o.MaxConns
	if conns <= 0 {
		conns = 64
	}
	tr, err := minio.DefaultTransport(o.Secure)
	if err != nil {
		return nil, fmt.Errorf("object: client: %w", err)
	}
	tr.MaxIdleConns, tr.MaxIdleConnsPerHost, tr.MaxConnsPerHost = conns, conns, conns
	tr.ResponseHeaderTimeout = 30 * time.Second
	mc, err := minio.New(o.Host, &minio.Options{
		Creds: creds, Secure: o.Secure, Region: o.Region, Transport: tr,
		// A failed request is the breaker's business, not a retry loop's:
		// retries would hold an upload slot through an outage.
		MaxRetries: 1,
	})
	if err != nil {
		return nil, fmt.Errorf("object: client for %s: %w", o.Host, err)
	}
	return &Client{mc: mc, bucket: o.Bucket, secret: o.SecretKey}, nil
}

// Bucket is the bucket's name.
func (c *Client) Bucket() string { return c.bucket }

// EnsureBucket creates the bucket when it does not exist.
func (c *Client) EnsureBucket(ctx context.Context, region string) error {
	ok, err := c.mc.BucketExists(ctx, c.bucket)
	if err != nil {
		return fmt.Errorf("object: bucket %s: %w", c.bucket, err)
	}
	if ok {
		return nil
	}
	err = c.mc.MakeBucket(ctx, c.bucket, minio.MakeBucketOptions{Region: region})
	if err != nil {
		code := minio.ToErrorResponse(err).Code
		if code == "BucketAlreadyOwnedByYou" || code == "BucketAlreadyExists" {
			return nil // another instance created it meanwhile
		}
		return fmt.Errorf("object: create bucket %s: %w", c.bucket, err)
	}
	return nil
}

// PutIfAbsent stores body under key unless an object is already there
// (If-None-Match: *): created is false when another writer got there first.
// A server that ignores the condition overwrites with the same bytes.
func (c *Client) PutIfAbsent(ctx context.Context, key string, body []byte) (created bool, err error) {
	opts := minio.PutObjectOptions{ContentType: "application/octet-stream", DisableMultipart: true,
		DisableContentSha256: true, SendContentMd5: false}
	opts.SetMatchETagExcept("*")
	_, err = c.mc.PutObject(ctx, c.bucket, key, bytes.NewReader(body), int64(len(body)), opts)
	if err != nil {
		if r := minio.ToErrorResponse(err); r.Code == minio.PreconditionFailed || r.StatusCode == http.StatusPreconditionFailed {
			return false, nil
		}
		return false, err
	}
	return true, nil
}

// Get reads the object under key into buf when it fits (else a new slice)
// and returns the bytes. ErrNotFound when there is none; an object larger
// than limit is an error (ErrCorrupt). A body that ends early (a connection
// cut, a declared length not met) is a transport error, never a short body.
func (c *Client) Get(ctx context.Context, key string, buf []byte, limit int) ([]byte, error) {
	b, err := c.get(ctx, key, buf, limit)
	if err == nil && len(b) > limit {
		return nil, fmt.Errorf("%w: object %s is larger than %d bytes", ErrCorrupt, key, limit)
	}
	return b, err
}

// get reads at most limit+1 bytes of the object under key into buf (its
// capacity; a new slice when it is too small), so that a caller sees an
// oversized object's first bytes.
func (c *Client) get(ctx context.Context, key string, buf []byte, limit int) ([]byte, error) {
	obj, err := c.mc.GetObject(ctx, c.bucket, key, minio.GetObjectOptions{})
	if err != nil {
		return nil, notFound(err)
	}
	defer obj.Close()
	if cap(buf) < limit+1 {
		buf = make([]byte, limit+1)
	}
	buf = buf[:limit+1]
	n := 0
	for n < len(buf) {
		m, err := obj.Read(buf[n:])
		n += m
		if errors.Is(err, io.EOF) {
			return buf[:n], nil
		}
		if err != nil {
			return nil, notFound(err)
		}
	}
	return buf, nil
}

// Head reports whether an object exists under key.
func (c *Client) Head(ctx context.Context, key string) (bool, error) {
	_, err := c.mc.StatObject(ctx, c.bucket, key, minio.StatObjectOptions{})
	if err == nil {
		return true, nil
	}
	if err = notFound(err); errors.Is(err, ErrNotFound) {
		return false, nil
	}
	return false, err
}

// ObjectKey is the MAC key of this bucket's objects derived from the
// client's own credentials, overridden by override when it is set
// (DYN_KVBM_STORAGE_SECRET): see integrity.ObjectKey.
func (c *Client) ObjectKey(override []byte) integrity.Key {
	return integrity.ObjectKey(override, c.secret, c.bucket)
}

// Delete removes the object under key (no error when absent).
func (c *Client) Delete(ctx context.Context, key string) error {
	return c.mc.RemoveObject(ctx, c.bucket, key, minio.RemoveObjectOptions{})
}

func notFound(err error) error {
	r := minio.ToErrorResponse(err)
	if r.Code == minio.NoSuchKey || r.StatusCode == http.StatusNotFound {
		return fmt.Errorf("%w: %v", ErrNotFound, err)
	}
	return err
}
