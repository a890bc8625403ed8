package config

import (
	"fmt"
	"net"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// G4: the object-storage tier shared by every engine instance (Dynamo's
// DYN_KVBM_OBJECT_* names).
const (
	EnvObjectEnabled      = "DYN_KVBM_OBJECT_ENABLED"
	EnvObjectBucket       = "DYN_KVBM_OBJECT_BUCKET"
	EnvObjectEndpoint     = "DYN_KVBM_OBJECT_ENDPOINT"
	EnvObjectRegion       = "DYN_KVBM_OBJECT_REGION"
	EnvObjectAccessKey    = "DYN_KVBM_OBJECT_ACCESS_KEY"
	EnvObjectSecretKey    = "DYN_KVBM_OBJECT_SECRET_KEY"
	EnvObjectWriteThrough = "DYN_KVBM_OBJECT_WRITE_THROUGH"
	EnvObjectNumBlocks    = "DYN_KVBM_OBJECT_NUM_BLOCKS"
	// EnvObjectLookupTimeoutSecs bounds one request's look-up in the bucket
	// (whole seconds, at least 1): a request waits at most this long before
	// it loads what was found by then (a kvbm variable).
	EnvObjectLookupTimeoutSecs = "DYN_KVBM_OBJECT_LOOKUP_TIMEOUT_SECS"
	EnvAWSAccessKeyID          = "AWS_ACCESS_KEY_ID"
	EnvAWSSecretAccessKey      = "AWS_SECRET_ACCESS_KEY"
)

// Defaults of the G4 variables.
const (
	DefaultObjectRegion    = "us-east-1"
	DefaultObjectEndpoint  = "https://s3.amazonaws.com"
	DefaultObjectNumBlocks = 100000
	// DefaultObjectLookupTimeout: a nearby store answers a wave of HEAD
	// requests in milliseconds; a request stops waiting after this.
	DefaultObjectLookupTimeout = 2 * time.Second
	// ObjectWorkerIDPlaceholder in DYN_KVBM_OBJECT_BUCKET is replaced by the
	// engine instance's worker id (one bucket per instance; leave it out to
	// share one bucket between instances).
	ObjectWorkerIDPlaceholder = "{worker_id}"
)

// Object is the G4 configuration. Zero value: disabled.
type Object struct {
	Enabled bool
	// Bucket may contain ObjectWorkerIDPlaceholder (see BucketFor).
	Bucket string
	// Endpoint is scheme://host[:port]; Secure is its scheme being https.
	Endpoint  string
	Host      string // host[:port] of Endpoint
	Secure    bool
	Region    string
	AccessKey string
	SecretKey string
	// WriteThrough keeps a block in G2 after its G4 upload (default); off,
	// the G2 copy is released as soon as the upload is queued.
	WriteThrough bool
	// NumBlocks caps the local registry of blocks known to be in G4.
	NumBlocks int
	// LookupTimeout bounds one request's look-up in the bucket.
	LookupTimeout time.Duration
}

// S3 bucket names: 3–63 characters, lower-case letters, digits, dots and
// hyphens, starting and ending with a letter or digit.
var bucketRE = regexp.MustCompile(`^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$`)

// BucketFor substitutes workerID into the bucket name.
func (o *Object) BucketFor(workerID uint64) string {
	return strings.ReplaceAll(o.Bucket, ObjectWorkerIDPlaceholder, strconv.FormatUint(workerID, 10))
}

// object parses the G4 variables. They are only required when
// DYN_KVBM_OBJECT_ENABLED is on; set but malformed ones are errors anyway.
func (p *parser) object() Object {
	o := Object{
		Enabled:       p.boolean(EnvObjectEnabled, false),
		Bucket:        p.str(EnvObjectBucket, ""),
		Region:        p.str(EnvObjectRegion, DefaultObjectRegion),
		AccessKey:     p.str(EnvObjectAccessKey, ""),
		SecretKey:     p.str(EnvObjectSecretKey, ""),
		WriteThrough:  p.boolean(EnvObjectWriteThrough, true),
		NumBlocks:     p.capped(EnvObjectNumBlocks, DefaultObjectNumBlocks, 1),
		LookupTimeout: p.seconds(EnvObjectLookupTimeoutSecs, DefaultObjectLookupTimeout),
	}
	// Credentials: both DYN_KVBM_OBJECT_* or both from AWS_*; none at all
	// means anonymous requests.
	accessVar, secretVar := EnvObjectAccessKey, EnvObjectSecretKey
	if o.AccessKey == "" && o.SecretKey == "" {
		o.AccessKey, o.SecretKey = p.str(EnvAWSAccessKeyID, ""), p.str(EnvAWSSecretAccessKey, "")
		accessVar, secretVar = EnvAWSAccessKeyID, EnvAWSSecretAccessKey
	}
	if !o.Enabled {
		return Object{} // the variables were still checked for malformed values
	}
	if (o.AccessKey == "") != (o.SecretKey == "") {
		if o.AccessKey == "" {
			p.fail(accessVar, "", "must be set with "+secretVar)
		} else {
			p.fail(secretVar, "", "must be set with "+accessVar)
		}
	}
	if o.Bucket == "" {
		p.fail(EnvObjectBucket, "", "required when "+EnvObjectEnabled+" is on")
	} else if name := strings.ReplaceAll(o.Bucket, ObjectWorkerIDPlaceholder, "0"); !bucketRE.MatchString(name) ||
		strings.Contains(name, "..") {
		p.fail(EnvObjectBucket, o.Bucket, "not an S3 bucket name (3-63 characters: a-z, 0-9, '.', '-'; "+
			ObjectWorkerIDPlaceholder+" is replaced by the worker id)")
	}
	raw := p.str(EnvObjectEndpoint, DefaultObjectEndpoint)
	if !strings.Contains(raw, "://") {
		raw = "https://" + raw
	}
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		p.fail(EnvObjectEndpoint, raw, err.Error())
	case u.Scheme != "http" && u.Scheme != "https":
		p.fail(EnvObjectEndpoint, raw, "scheme must be http or https")
	case u.Host == "" || (u.Path != "" && u.Path != "/") || u.RawQuery != "":
		p.fail(EnvObjectEndpoint, raw, "want scheme://host[:port] without a path (the bucket is "+EnvObjectBucket+")")
	default:
		if _, port, err := net.SplitHostPort(u.Host); err == nil {
			if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
				p.fail(EnvObjectEndpoint, raw, "port must be 1..65535")
			}
		}
		o.Endpoint, o.Host, o.Secure = u.Scheme+"://"+u.Host, u.Host, u.Scheme == "https"
	}
	return o
}

// summary is the G4 line of Config.Summary.
func (o *Object) summary() string {
	if !o.Enabled {
		return "  object (G4) tier: disabled\n"
	}
	creds := "anonymous"
	if o.AccessKey != "" {
		creds = "access key " + o.AccessKey[:min(4, len(o.AccessKey))] + "…"
	}
	return fmt.Sprintf("  object (G4) tier: bucket %s at %s (region %s, %s), write-through %s, registry %d blocks, "+
		"look-ups time out after %s\n",
		o.Bucket, o.Endpoint, o.Region, creds, onOff(o.WriteThrough), o.NumBlocks, o.LookupTimeout)
}

// CheckObject checks what G4 needs from the other tiers: downloads land in
// G2 before G1, so the host tier must be configured.
func (c *Config) CheckObject() error {
	if c.Object.Enabled && !c.HostEnabled() {
		return &VarError{Name: EnvObjectEnabled, Value: "1",
			Reason: "the object tier needs the host tier: set " + EnvCPUCacheGB + " or " + EnvCPUCacheOverrideBlocks}
	}
	return nil
}
